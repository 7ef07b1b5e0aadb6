"""Chunked prefill under a burst: does a prompt burst stall the sessions already decoding?

4 sessions decode steadily; then 4 new sessions arrive with 1,000-token prompts.
For each prefill chunk size (tokens per tick) and unchunked (a whole prompt in
one tick, never split), a fresh node measures the in-flight sessions' worst and
p99 inter-token latency during the burst vs steady, and the burst's TTFT.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from meshnode.bench import model_path, token_gaps
from meshnode.dev.nodeproc import NodeProcess

CHUNKS = [16, 32, 64, 128, 512]
BURST_PROMPT = 1000
UNCHUNKED = BURST_PROMPT  # a whole prompt per tick


def one(path: str, threads: int, chunk: int, extra: tuple = (), python: str | None = None) -> dict:
    n_batch = max(512, chunk + 8)
    args = ["--max-active", "8", "--prefill-chunk", str(chunk), "--n-batch", str(n_batch), "--ctx", "8192",
            "--threads", str(threads), "--log-level", "WARNING", *extra]
    with NodeProcess(path, *args, python=python) as node, node.client(timeout_s=600) as c:
        steady = [f"s{i}" for i in range(4)]
        for i, sid in enumerate(steady):  # 4 x (8 + 1000) + 4 x (1000 + 4) KV cells fit --ctx 8192
            c.submit(sid, tokens=[3 + (i * 7 + k) % 500 for k in range(8)], max_tokens=1000, ignore_eos=True)
        times: dict[str, list[float]] = {sid: [] for sid in steady}
        first: dict[str, float] = {}

        def pump(until) -> None:
            while not until():
                ev = c.recv(600)
                if ev is None:
                    raise TimeoutError("node stopped answering")
                if ev["event"] == "tokens":
                    sid = ev["id"]
                    if sid in times:
                        times[sid].append(time.monotonic())
                    elif sid not in first:
                        first[sid] = time.monotonic()

        pump(lambda: min(len(t) for t in times.values()) >= 25)  # steady state
        t_burst = time.monotonic()
        burst = [f"b{i}" for i in range(4)]
        for i, sid in enumerate(burst):
            c.submit(sid, tokens=[3 + (i * 31 + k * 13) % 500 for k in range(BURST_PROMPT)], max_tokens=4,
                     ignore_eos=True)
        pump(lambda: len(first) == len(burst))
        t_end = time.monotonic()
        for sid in steady + burst:
            c.cancel(sid)
    steady_gaps = token_gaps(times, 0, t_burst)
    burst_gaps = token_gaps(times, t_burst, t_end)
    ttft = [(first[s] - t_burst) * 1e3 for s in first]
    return {"chunk": chunk, "steady_itl_ms_p99": float(np.percentile(steady_gaps, 99)),
            "steady_itl_ms_max": float(max(steady_gaps)),
            "burst_itl_ms_p99": float(np.percentile(burst_gaps, 99)) if burst_gaps else 0.0,
            "burst_itl_ms_max": float(max(burst_gaps)) if burst_gaps else 0.0,
            "burst_ttft_ms_mean": float(np.mean(ttft)), "burst_ttft_ms_max": float(max(ttft))}


def choose(rows: list[dict]) -> int | None:
    """The default chunk: cuts the worst in-flight ITL >= 10x vs unchunked with burst TTFT <= 1.3x."""
    base = next(r for r in rows if r["chunk"] == UNCHUNKED)
    ok = [r for r in rows if r["chunk"] != UNCHUNKED and r["burst_itl_ms_max"] * 10 <= base["burst_itl_ms_max"]
          and r["burst_ttft_ms_mean"] <= 1.3 * base["burst_ttft_ms_mean"]]
    return min(ok, key=lambda r: r["burst_ttft_ms_mean"])["chunk"] if ok else None


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    rows = []
    for chunk in CHUNKS + [UNCHUNKED]:
        rows.append(one(path, threads, chunk))
    base = rows[-1]
    print(f"model {os.path.basename(path)}: 4 sessions decoding, then 4 arrive with {BURST_PROMPT}-token prompts")
    print(f"{'chunk':>10}{'steady ITL p99':>16}{'burst ITL p99':>15}{'burst ITL max':>15}{'vs unchunked':>14}"
          f"{'burst TTFT mean':>17}{'vs unchunked':>14}")
    for r in rows:
        name = "unchunked" if r["chunk"] == UNCHUNKED else str(r["chunk"])
        print(f"{name:>10}{r['steady_itl_ms_p99']:16.1f}{r['burst_itl_ms_p99']:15.1f}{r['burst_itl_ms_max']:15.1f}"
              f"{base['burst_itl_ms_max'] / max(r['burst_itl_ms_max'], 1e-9):13.1f}x"
              f"{r['burst_ttft_ms_mean']:17.0f}{r['burst_ttft_ms_mean'] / base['burst_ttft_ms_mean']:13.2f}x")
    pick = choose(rows)
    print(f"default chunk choice (worst ITL cut >= 10x, TTFT <= 1.3x): {pick if pick else 'none qualifies'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "burst_prompt": BURST_PROMPT, "rows": rows,
                       "unchunked_chunk": UNCHUNKED, "chosen": pick}, f, indent=2)
    return 0
