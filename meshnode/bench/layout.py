"""`meshnode bench layout`: the unified KV pool vs per-sequence streams vs deterministic mode, side by side.

Three workloads, each through fresh nodes, in rounds whose order rotates so
drift on a shared machine hits every mode alike:
- mix: the 16 jobs of the overhead bench (prompts 4-100, 32 new) at concurrency 8;
- decode: 8 sessions of 4-token prompts generating 128 tokens each, all at once;
- burst: bench burst's workload with the default prefill pacing (4 decoding, then 4 prompts of 1,000
  tokens), the prefix cache on as by default.
Deterministic mode holds only on a llama.cpp built without llamafile (docs/determinism.md): with
--deterministic-python, its nodes run under that interpreter; without, and where this build refuses,
the row says why. The verdict: deterministic's cost on the mix against the best layout's, and the burst.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from meshnode.bench import model_path
from meshnode.bench.burst import one as burst_one
from meshnode.bench.overhead import jobs, through_node

MODES = {"unified": ("--kv-layout", "unified"), "streams": ("--kv-layout", "streams"), "deterministic": ("--deterministic",)}


def refusal(python: str, path: str) -> str:
    """Why deterministic mode cannot run under `python` for this model ("" if it can)."""
    code = f"from meshnode.engine.llamacpp import deterministic_problem as p; print(p({path!r}))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


def decode_work(n_tokens: int = 128):
    return [(f"d{i}", [3 + i, 4, 5, 6], n_tokens) for i in range(8)]


def id_gaps(path: str, threads: int, ticks: int = 30) -> dict:
    """Whether packing streams down when a session ends (meshnode/engine/seqmap.py) pays for itself: eight
    sequences with 300-token prompts, then the odd ones end; decode ticks of the four left, packed onto
    streams 0-3 vs left on 0, 2, 4, 6, and the cost of the tick that carries the four stream copies."""
    import time

    import numpy as np

    from meshnode.core.types import GREEDY, Plan, SeqChunk
    from meshnode.engine.llama import EngineConfig, LlamaEngine

    def run(pack: bool) -> tuple[float, float]:
        cfg = EngineConfig(path, n_seq_max=8, n_ctx=8 * 512, n_threads=threads, kv_layout="streams")
        with LlamaEngine(cfg) as e:
            if not pack:
                e._ids.compaction = list  # the measurement's control: streams stay where they were
            for s in range(8):
                e.step(Plan([SeqChunk(s, 0, np.arange(3, 303, dtype=np.int32), draw=0, sampling=GREEDY)]))
            left, pos = [0, 2, 4, 6], 300
            t0 = time.perf_counter()
            e.step(Plan([SeqChunk(s, pos, np.array([7], np.int32), draw=1) for s in left], release=[1, 3, 5, 7]))
            first = (time.perf_counter() - t0) * 1e3
            times = []
            for k in range(ticks):
                t0 = time.perf_counter()
                e.step(Plan([SeqChunk(s, pos + 1 + k, np.array([7], np.int32), draw=k + 2) for s in left]))
                times.append(time.perf_counter() - t0)
            return first, float(np.median(times) * 1e3)

    first_packed, packed = run(True)
    first_gapped, gapped = run(False)
    return {"tick_ms_packed": packed, "tick_ms_gapped": gapped, "first_tick_ms_packed": first_packed,
            "first_tick_ms_gapped": first_gapped}


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    pythons = {"unified": sys.executable, "streams": sys.executable,
               "deterministic": a.deterministic_python or sys.executable}
    refused = refusal(pythons["deterministic"], path)
    modes = [m for m in MODES if not (m == "deterministic" and refused)]
    rows = {m: {"mix": [], "decode": [], "burst": []} for m in modes}
    for r in range(a.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for m in order:
            extra, py = MODES[m], pythons[m]
            rows[m]["mix"].append(through_node(path, threads, jobs(32), extra=extra, python=py)["gen_tok_s"])
            rows[m]["decode"].append(through_node(path, threads, decode_work(), extra=extra, python=py)["gen_tok_s"])
            rows[m]["burst"].append(burst_one(path, threads, None, extra=extra, python=py))
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    print(f"model {os.path.basename(path)}, threads {threads}, {a.rounds} rounds (order rotating)")
    print(f"{'mode':>14}{'mix tok/s':>12}{'decode tok/s':>14}{'burst worst gap ms':>20}{'last burst TTFT s':>19}")
    for m in modes:
        mix, dec, burst = rows[m]["mix"], rows[m]["decode"], rows[m]["burst"]
        print(f"{m:>14}{mean(mix):12.1f}{mean(dec):14.1f}{max(b['burst_itl_ms_max'] for b in burst):20.0f}"
              f"{mean([b['burst_ttft_ms_max'] for b in burst]) / 1e3:19.2f}")
        print(f"{'':>14}  per round: mix {[round(x, 1) for x in mix]}, decode {[round(x, 1) for x in dec]}")
    if refused:
        print(f"deterministic: not measured, {refused}")
    best = max(("unified", "streams"), key=lambda m: mean(rows[m]["mix"]))
    verdict = {"best_layout_on_mix": best}
    if "deterministic" in rows:
        cost = 1 - mean(rows["deterministic"]["mix"]) / mean(rows[best]["mix"])
        verdict["deterministic_cost_on_mix"] = cost
        print(f"deterministic costs {cost:.1%} of the best layout ({best}) on the mix (goal <= 10%)")
    gaps = id_gaps(path, threads)
    saved = gaps["tick_ms_gapped"] - gaps["tick_ms_packed"]
    cost = gaps["first_tick_ms_packed"] - gaps["first_tick_ms_gapped"]
    print(f"streams, 4 sequences decoding: packed on 0-3 {gaps['tick_ms_packed']:.1f} ms a tick, left on 0,2,4,6 "
          f"{gaps['tick_ms_gapped']:.1f} ms; the tick carrying the moves costs {cost:.1f} ms more"
          + (f", repaid after {max(cost, 0) / saved:.2f} ticks" if saved > 0 else ": packing does not pay here"))
    verdict["id_gaps"] = gaps
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "rounds": rows, "refused": refused, "verdict": verdict,
                       "pythons": pythons}, f, indent=2)
    return 0
