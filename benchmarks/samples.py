"""Where a tick's sampled ids should travel back from the engine: through the shared arena's output half
(written by the engine's writer thread, read by the front, one int32 per chunk) or inside the tick's
msgpack answer, which crosses the link anyway (issue 54, item 2).

Both ways are timed here in one process, engine side and front side together, for a decode tick of 1, 8
and 64 rows: the answer's map packed and unpacked as ipc/link.py does for TickDone (its other fields at
a decode tick's typical values), plus, for the arena, the write of each chunk's token and the read back.
Rounds alternate the two ways; the figure is the median of rounds, in microseconds a tick.
"""
from __future__ import annotations

import json
import time

import numpy as np

from ipc.protocol import pack, unpack
from meshnode.bench import llama_build

ITERS = 2000


def _answer(rows: int) -> dict:
    return {"kind": "done", "tick": 12345, "gap_ms": 0.4, "rss": 1 << 30, "mem_available": 1 << 34,
            "mem_total": 1 << 35, "cache_miss": [], "step_ms": 9.7, "kv_cells": 300 * rows, "logprobs": [],
            "drafted": 0, "served": 0, "failed": []}


def via_arena(rows: int, out: np.ndarray) -> float:
    seqs, tokens = list(range(rows)), {s: 1000 + s for s in range(rows)}
    t0 = time.perf_counter()
    for _ in range(ITERS):
        for k, s in enumerate(seqs):  # the engine's writer, as link.write_samples did
            out[k] = tokens.get(s, -1)
        m = unpack(pack(_answer(rows)))
        got = {s: int(out[k]) for k, s in enumerate(seqs)}  # the front, as link.read_samples did
        assert m["tick"] == 12345 and all(0 <= t < 49152 for t in got.values())
    return (time.perf_counter() - t0) / ITERS * 1e6


def via_message(rows: int) -> float:
    tokens = {s: 1000 + s for s in range(rows)}
    t0 = time.perf_counter()
    for _ in range(ITERS):
        m = unpack(pack({**_answer(rows), "tokens": [list(tokens), list(tokens.values())]}))
        seqs, toks = m["tokens"]
        got = dict(zip(seqs, toks))
        assert m["tick"] == 12345 and all(0 <= t < 49152 for t in got.values())
    return (time.perf_counter() - t0) / ITERS * 1e6


def main(a) -> int:
    out = np.zeros(256, dtype=np.int32)
    rounds = max(3, a.rounds)
    figures = {}
    print(f"bench samples: a decode tick's sampled ids back from the engine, {rounds} rounds x {ITERS} ticks, "
          f"us a tick (engine + front side, median of rounds); {llama_build()}")
    for rows in (1, 8, 64):
        arena, message = [], []
        for _ in range(rounds):
            arena.append(via_arena(rows, out))
            message.append(via_message(rows))
        figures[rows] = {"arena_us": float(np.median(arena)), "message_us": float(np.median(message))}
        f = figures[rows]
        print(f"  {rows:2d} rows: arena {f['arena_us']:.1f} us, in the message {f['message_us']:.1f} us "
              f"({f['message_us'] / f['arena_us']:.2f}x)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rounds": rounds, "iters": ITERS, "rows": figures, "build": llama_build()}, fh, indent=1)
    return 0
