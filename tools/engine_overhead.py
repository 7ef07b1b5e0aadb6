#!/usr/bin/env python3
"""The engine's own Python around llama_decode, per decode tick, in process (issue 28, item 1).

    python tools/engine_overhead.py [--sessions 8] [--preset bench] [--seeded] [--parts]

N sequences decode together through LlamaEngine.step with the node's default engine settings
(NodeConfig: deterministic where it holds, streams); llama_decode is timed from the inside (the
llama_cpp module's function, replaced for this process only), so "outside" is everything a step
does that is not llama_decode: validation, batch filling, logits views, sampling, bookkeeping.
`--parts` also times each of the engine's steps on its own. Prints llama_print_system_info.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from meshnode.bench import llama_build
from meshnode.core.types import Plan, Sampling, SeqChunk
from meshnode.engine.llama import LlamaEngine
from meshnode.ops.config import engine_config
from meshnode.ops.models import cached_model

TICKS = 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--seeded", action="store_true", help="temperature 0.8, seeded, instead of greedy")
    ap.add_argument("--parts", action="store_true")
    a = ap.parse_args()
    n = a.sessions
    e = LlamaEngine(engine_config(str(cached_model(a.preset)), max_active=max(8, n)))
    inside = [0.0]
    decode = e._lc.llama_decode

    def timed(ctx, batch):
        t = time.perf_counter()
        rc = decode(ctx, batch)
        inside[0] += time.perf_counter() - t
        return rc
    e._lc.llama_decode = timed
    sampling = Sampling(temperature=0.8, seed=1) if a.seeded else None
    pos, last = [0] * n, [3 + i for i in range(n)]

    def tick(first: bool = False) -> float:
        chunks = [SeqChunk(i, pos[i], np.array([last[i]], np.int32), draw=pos[i], sampling=sampling if first else None)
                  for i in range(n)]
        res = e.step(Plan(chunks, [], []))
        for i in range(n):
            pos[i], last[i] = pos[i] + 1, res.tokens[i]
        return res.step_ms

    tick(True)
    for _ in range(10):
        tick()
    inside[0], step = 0.0, 0.0
    for _ in range(TICKS):
        step += tick()
    step, dec = step / TICKS, inside[0] * 1e3 / TICKS
    print(f"{llama_build()}\n{a.preset}, {n} sessions, {'seeded' if a.seeded else 'greedy'}, deterministic "
          f"{e.deterministic}: step {step:.3f} ms, llama_decode {dec:.3f} ms, outside {step - dec:.3f} ms a tick")
    if a.parts:
        spent: dict[str, float] = {}
        for name in ("begin", "_groups", "_fill", "_even", "_outputs", "_logits", "sample", "end"):
            def wrap(f, name=name):
                def w(*args, **kw):
                    t = time.perf_counter()
                    try:
                        return f(*args, **kw)
                    finally:
                        spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
                return w
            setattr(e, name, wrap(getattr(e, name)))
        for _ in range(TICKS):
            tick()
        print("ms a tick: " + ", ".join(f"{k} {v * 1e3 / TICKS:.3f}" for k, v in spent.items()))
    e.close()


if __name__ == "__main__":
    main()
