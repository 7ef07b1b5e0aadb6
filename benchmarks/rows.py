"""`python -m benchmarks rows`: what a tick of one sequence's 1 to 48 rows costs, the price of K drafts.

Speculative decoding verifies K drafts as K more rows of the sequence's chunk (docs/speculative.md): it
pays where a tick of K + 1 rows costs much less than K + 1 ticks of one, as on a GPU, and barely where a
row costs about what a decode does. In process, deterministic mode and not, a sequence is filled to
`--tokens` x 16 positions (default 512), then a chunk of n rows at its end is computed and cut again, five
times each; the fastest of the five is printed, with the ratio to one row's.
"""
from __future__ import annotations

import json
import os

import numpy as np

from meshnode.bench import llama_build, model_path
from meshnode.core.types import GREEDY, Keep, Plan, SeqChunk
from meshnode.engine.llama import LlamaEngine
from meshnode.engine.llamacpp import deterministic_problem
from meshnode.ops.config import NodeConfig

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)


def costs(path: str, threads: int, deterministic: bool, depth: int) -> dict[int, float]:
    cfg = NodeConfig(model=path, threads=threads, deterministic=deterministic, spec="off")
    toks = lambda n, base=0: (np.arange(base, base + n) % 20000 + 100).astype(np.int32)  # noqa: E731
    with LlamaEngine(cfg.resolve().engine) as e:
        for pos in range(0, depth, 256):
            n = min(256, depth - pos)
            e.step(Plan([SeqChunk(0, pos, toks(n, pos), draw=0 if pos + n == depth else -1,
                                  sampling=GREEDY if pos == 0 else None)]))
        out = {}
        for n in ROWS:
            ms = []
            for _ in range(5):
                res = e.step(Plan([SeqChunk(0, depth, toks(n, 7), draw=1, sampling=GREEDY)]))
                ms.append(res.step_ms)
                e.step(Plan([], [], [Keep(0, depth)]))
            out[n] = min(ms)
    return out


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    depth = a.tokens * 16
    print(f"bench rows: {os.path.basename(path)}, one sequence at depth {depth}, threads {threads}; {llama_build()}")
    got = {}
    for det in (True, False):
        name = "deterministic" if det else "not deterministic"
        refused = deterministic_problem(path) if det else ""
        if refused:
            print(f"  (no {name} pass: {refused})")
            continue
        got[name] = costs(path, threads, det, depth)
        one = got[name][1]
        print(f"  {name:<18} " + "  ".join(f"{n}: {ms:.1f} ms ({ms / one:.2f}x)" for n, ms in got[name].items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "depth": depth, "ms": got}, f,
                      indent=1)
    return 0
