"""What a tick costs by its shape, in process: the facts the tick cost model and prefill sizing rest on.

On the node's default layout (streams), with the engine alone (no front, no clients), each
round times, interleaved so that drifts of the machine hit every shape alike:
- prompt chunks of 32, 63, 64, 128, 146 and 192 tokens at position 0 and at DEEP: llama.cpp's CPU
  flash attention tiles calls of >= 64 rows, runs smaller ones row by row, and computes a last,
  partial tile whole (core/costmodel.py, TILE_ROWS; core/scheduler.py, fill);
- a 192-token chunk alone vs beside 4 decode rows (a second llama_decode call on streams);
- 4 decode rows alone, for the steady-state spread of the engine itself (the floor under any
  inter-token p99 the node can show on this machine).
Figures are the median over rounds of each shape's time; ratios are taken from those medians.
"""
from __future__ import annotations

import json
import os

import numpy as np

from meshnode.bench import llama_build, model_path

DEEP = 800  # a prompt position well past the first tiles (streams of 1024 cells; + 192 fits)
SIZES = (32, 63, 64, 128, 146, 192)
DECODE_STEPS = 400


def measure(path: str, threads: int, rounds: int) -> dict:
    from meshnode.core.types import GREEDY, Keep, Plan, SeqChunk
    from meshnode.engine.llama import LlamaEngine
    from meshnode.ops.config import engine_config

    toks = lambda n, s=0: ((np.arange(n) + 7 * s) % 500 + 3).astype(np.int32)  # noqa: E731
    times: dict[str, list[float]] = {}
    cfg = engine_config(path, n_seq_max=8, ctx=8192, n_batch=512, threads=threads, kv_layout="streams",
                        deterministic=False)
    with LlamaEngine(cfg) as e:
        e.step(Plan([SeqChunk(0, 0, toks(512))]))  # seq 0: a deep prompt, cut back to DEEP before each chunk
        e.step(Plan([SeqChunk(0, 512, toks(DEEP - 512))]))
        e.step(Plan([SeqChunk(s, 0, toks(8, s), draw=0) for s in range(1, 5)]))  # seqs 1-4 decode
        pos = 8

        def decode_rows() -> list:
            nonlocal pos
            pos += 1
            return [SeqChunk(s, pos - 1, toks(1, s), draw=0, sampling=GREEDY) for s in range(1, 5)]

        def run(key: str, plan: Plan) -> None:
            times.setdefault(key, []).append(e.step(plan).step_ms)

        for _ in range(rounds):
            for n in SIZES:
                run(f"chunk {n} at 0", Plan([SeqChunk(5, 0, toks(n, 5))], release=[5]))
                run(f"chunk {n} at {DEEP}", Plan([SeqChunk(0, DEEP, toks(n))], kv=[Keep(0, DEEP)]))
            run("chunk 192 at 0, alone", Plan([SeqChunk(5, 0, toks(192, 5))], release=[5]))
            run("chunk 192 at 0, beside 4 decode rows", Plan(decode_rows() + [SeqChunk(5, 0, toks(192, 5))], release=[5]))
            run("4 decode rows", Plan(decode_rows()))
        steps = [e.step(Plan(decode_rows())).step_ms for _ in range(DECODE_STEPS)]
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"median_ms": med, "rounds_ms": times, "decode_steps_ms_p50": float(np.percentile(steps, 50)),
            "decode_steps_ms_p99": float(np.percentile(steps, 99)), "decode_steps": DECODE_STEPS}


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    print(f"model {os.path.basename(path)}: tick shapes in process, streams layout, threads {threads}, "
          f"{a.rounds} rounds; {llama_build()}")
    r = measure(path, threads, a.rounds)
    m = r["median_ms"]
    for n in SIZES:
        print(f"  chunk {n:>3}: at 0 {m[f'chunk {n} at 0']:7.1f} ms ({m[f'chunk {n} at 0'] / n:.2f}/row)"
              f"   at {DEEP} {m[f'chunk {n} at {DEEP}']:7.1f} ms ({m[f'chunk {n} at {DEEP}'] / n:.2f}/row)")
    deep = lambda n: m[f"chunk {n} at {DEEP}"]  # noqa: E731
    mixed = m["chunk 192 at 0, beside 4 decode rows"] - m["chunk 192 at 0, alone"]
    out = {"row_by_row_vs_tiled_at_depth": deep(63) / deep(64),
           "partial_tile_per_row_vs_whole": (deep(146) / 146) / (deep(128) / 128),
           "beside_decode_extra_ms": mixed, "decode_alone_ms": m["4 decode rows"],
           "decode_steps_p99_over_p50": r["decode_steps_ms_p99"] / r["decode_steps_ms_p50"]}
    print(f"  at {DEEP}: 63 rows take {out['row_by_row_vs_tiled_at_depth']:.2f}x the time of 64 (row by row vs tiled)")
    print(f"  at {DEEP}: 146 rows cost {out['partial_tile_per_row_vs_whole']:.2f}x per row what 128 do (a partial tile)")
    print(f"  4 decode rows beside a 192-token chunk add {mixed:.1f} ms; alone they take {m['4 decode rows']:.1f} ms")
    print(f"  engine alone, {DECODE_STEPS} steps of 4 decode rows: p50 {r['decode_steps_ms_p50']:.1f} ms, "
          f"p99 {r['decode_steps_ms_p99']:.1f} ms, p99/p50 {out['decode_steps_p99_over_p50']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "deep": DEEP, "rounds": a.rounds,
                       **r, "ratios": out}, f, indent=2)
    return 0
