"""The engine's timed start-up ticks: what the front's tick cost model starts from.

Before the first client, ticks of known shapes are run and timed: the weights are
paged in, and the front's cost model (meshnode/core/costmodel.py) starts from real
points, so the first prompts are paced and the first `capacity` estimate is there,
instead of waiting for traffic varied enough to learn from.
"""
from __future__ import annotations

import numpy as np

from meshnode.core.costmodel import shape, sized
from meshnode.core.types import GREEDY, Keep, Plan, SeqChunk

CALIBRATION = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # prompt chunk sizes timed at the first start (<= n_batch)
DEPTHS = (2048, 1024, 512, 256)  # how deep one sequence is filled to time attention: the deepest that fits
DEPTH_BUDGET_MS = 3000.0  # ... in about this much start-up time (a big model on few cores gets a shallow one)
CHUNKS_BUDGET_MS = 4000.0  # the chunk sizes stop growing before their ticks would take longer than this
MIXED_CHUNKS = (64, 128, 256)  # prompt chunks timed beside decode rows: the first sized ticks' correction
MIXED_BUDGET_MS = 2000.0  # ... as many of them as fit in about this much start-up time (always the first)


def calibrate(engine) -> tuple:
    """Chunks at position 0 time the rows; one sequence then filled to a depth and decode rows
    beside it time attention, which a burst against a full KV pays and fresh chunks barely show; a
    chunk beside decode rows times the tick a burst runs (on streams a second llama_decode call).
    ((*costmodel.Shape, sized, ms), ...)"""
    unified = engine.cfg.kv_layout == "unified"
    toks = lambda n: (np.arange(n) % (engine.n_vocab - 3) + 3).astype(np.int32)  # noqa: E731
    largest = max(1, min(engine.n_batch, engine.n_ctx_seq - 1))  # a chunk and the token sampled after it
    engine.step(Plan([SeqChunk(0, 0, toks(min(8, largest)), draw=0)], [0]))  # not timed: pages the weights in
    out = []

    def timed(chunks: list, release=()) -> None:
        res = engine.step(Plan(chunks, list(release)))
        spans = [(c.pos, len(c.tokens)) for c in chunks]
        out.append((*shape(spans, res.kv_cells if unified else 0), sized(spans), res.step_ms))

    for n in [n for n in CALIBRATION if n <= largest]:
        # a big model on few cores: fewer, smaller; the next chunk's time is foreseen from the last one's
        # rows, so the budget is not overrun by a whole chunk (the time doubles with each)
        if n > 8 and sum(p[-1] for p in out) + out[-1][-1] * n / out[-1][1] > CHUNKS_BUDGET_MS:
            break
        timed([SeqChunk(0, 0, toks(n), draw=0)], [0])
    per_token = out[-1][-1] / out[-1][1]  # ms per row of the largest chunk
    depth = next((d for d in DEPTHS if d <= engine.n_ctx_seq // 2 and d * per_token <= DEPTH_BUDGET_MS), 0)
    step = min(256, engine.n_batch)
    engine.step(Plan([], [0]))
    for pos in range(0, depth, step):  # filling is itself a row of measurements: chunks ever deeper
        timed([SeqChunk(0, pos, toks(min(step, depth - pos)))])
    half = max(1, engine.n_seq_max // 2)
    shapes = [(k, 0) for k in sorted({half, engine.n_seq_max})]  # sequences decoding at once
    if half < engine.n_seq_max:  # and prompt chunks beside them, as a burst runs (on streams: two calls)
        mixed = [min(n, engine.n_batch - half, engine.n_ctx_seq - 1) for n in MIXED_CHUNKS]
        foreseen = np.cumsum([(n + half) * per_token for n in mixed])
        shapes += [(half, n) for i, n in enumerate(mixed) if i == 0 or foreseen[i] <= MIXED_BUDGET_MS]
    for k, chunk in shapes:
        deep = [SeqChunk(0, depth, toks(1), draw=0, sampling=GREEDY)] if depth else []
        prompt = [SeqChunk(k, 0, toks(chunk))] if chunk > 1 else []
        timed(deep + [SeqChunk(s, 0, toks(1), draw=0) for s in range(len(deep), k)] + prompt)
        others = list(range(len(deep), engine.n_seq_max))
        engine.step(Plan([], others, [Keep(0, depth)] if depth else []))  # back to seq 0 alone at depth
    engine.step(Plan([], list(range(engine.n_seq_max))))
    return tuple(out)

