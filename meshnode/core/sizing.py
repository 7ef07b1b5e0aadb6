"""How much one tick carries and what it will take: the scheduler's questions to the tick cost model.

Decode rows come first and are never cut; the prompt tokens beside them are sized
so the tick stays within the node's tick target (prefill_room below, then
within_target for the chunks as cut), in the cuts the engine computes fastest and,
in deterministic mode, in the tiles a cold run computes (costmodel.fill,
fill_deterministic). The cost model learns from every answered tick (Scheduler.apply).
"""
from __future__ import annotations

from typing import NamedTuple

from meshnode.core.costmodel import (TILE_ROWS, Shape, TickCost, fill, fill_deterministic, rows_per_call, shape,
                                     sized)
from meshnode.core.steps import budget_cadence

COLD_PREFILL = 64  # prompt tokens per tick beside decoders until the model has learned the engine
MIN_PREFILL = 8  # however tight the target, prompts advance
MIN_TARGET_MS = 50.0  # a ratio target never asks for ticks shorter than this: below it the per-tick costs
# outside the matrix products (the node's, llama.cpp's per call) take a growing share of prefill, and a
# 50 ms pause in a stream is not one a reader sees


class TickTarget(NamedTuple):
    """How long a tick with prompt rows may take while sessions decode: `ms` when set, else `ratio` times
    the decode-only tick those decoders take, all its steps (but at least MIN_TARGET_MS), so that the longest
    wait between two deliveries is the same number of the decoders' own on a slow CPU and a fast GPU, with
    one step a tick or several; neither: fixed chunks. Counted per step, a node whose streams get their
    tokens four steps a tick paced a burst at twice their steady gap, in small chunks each beside a decode
    call of its own, and a burst's last prompt started far later than llama-server's (evidence/tick-pacing.md).
    `steps_ms` (decode_steps_ms, where the node sets it): the steps counted are at most those the budget fits,
    not the one more its slack lets run (core/steps.py): with it, 8 rows of SmolLM2 q8_0 at 27 ms a step ran
    two a tick, 54 ms where 4 rows' ticks took 40, and a burst's tick beside them took 507 ms, 13x the streams'
    steady gap (evidence/burst-bench-smollm2-slack-only.txt, its third round)."""
    ms: float = 0.0
    ratio: float = 0.0
    steps_ms: float | None = None

    def __bool__(self) -> bool:
        return bool(self.ms or self.ratio)

    def bound_ms(self, cost: TickCost, decode_only: Shape) -> float:
        if self.ms:
            return self.ms
        cadence = cost.cadence_ms(decode_only)
        if self.steps_ms is not None:
            cadence = min(cadence, budget_cadence(cost.decode_tick_ms(decode_only), self.steps_ms))
        return max(MIN_TARGET_MS, self.ratio * cadence)


def within_target(cost: TickCost, target: TickTarget, decode: list, unified_cells: int, chunks: list) -> int:
    """How many of a tick's prompt `chunks` ((pos, n) each, in line) to keep so that its bound stays under the
    target: the room was sized for one chunk, and a prompt that finishes leaves the rest to the next in line,
    whose chunk is one more llama_decode call on streams (measured: those ticks ran 1.2-1.35x the target).
    The first chunk always stays, so prompts move."""
    if not decode or not target or not cost.ready or len(chunks) < 2:
        return len(chunks)
    limit = target.bound_ms(cost, shape(decode, unified_cells))
    keep = len(chunks)
    while keep > 1:
        cells = unified_cells + sum(n for _, n in chunks[:keep]) if unified_cells else 0
        if cost.bound(shape([*decode, *chunks[:keep]], cells)) <= limit:
            break
        keep -= 1
    return keep


def prefill_room(cost: TickCost, target: TickTarget, top: int, decode: list, unified_cells: int, pos: int) -> int:
    """Prompt tokens for a tick beside the `decode` rows ((pos, 1) each), the next prompt at position
    `pos`, `unified_cells` the cells a unified pool holds before the prompt rows (0 on streams). With
    nobody decoding, the most the budget allows (a bigger batch is computed more efficiently and no one
    waits between tokens); with decoders and a target, the most the model says fits it, but always
    some, so prompts move. Every row's attention counts the prompt rows the tick adds, as the fit saw."""
    if not decode or not target:
        return top
    if not cost.ready:
        return min(top, COLD_PREFILL)
    target_ms = target.bound_ms(cost, shape(decode, unified_cells))

    def fits(n: int) -> bool:
        return cost.bound(shape([*decode, (pos, n)], unified_cells + n if unified_cells else 0)) <= target_ms

    def largest(lo: int, hi: int) -> int:  # the largest n in [lo, hi] that fits, or lo - 1
        lo -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # the cost grows with n, but drops where the chunk becomes a tiled call of its own (streams):
    # search the tiled sizes first, then the small ones
    n = largest(TILE_ROWS, top) if top >= TILE_ROWS and not unified_cells else -1
    if n < TILE_ROWS:
        n = largest(1, min(top, TILE_ROWS - 1) if not unified_cells else top)
    return max(min(top, MIN_PREFILL), n)


class Sizing:
    def __init__(self, cost: TickCost, target: TickTarget, max_prefill: int, deterministic: bool, streams: bool):
        self.cost, self.target, self.max_prefill = cost, target, max_prefill
        self.deterministic, self.streams = deterministic, streams

    def prompt_cuts(self, decode: list, prompts: list[tuple[int, int, int]], cells: int) -> list[int]:
        """The prompt tokens each prompt in line ((position, tokens left, prompt length)) computes beside the
        `decode` rows' chunks, the pool holding `cells` (0 on streams): room sized at the first one's position,
        cut, and cut short where the cuts would overrun the target."""
        if not prompts:
            return []
        rows = [(c.pos, 1) for c in decode]
        sizes = self.cuts(self.room(rows, cells, prompts[0][0]), prompts, bool(decode))
        return sizes[:within_target(self.cost, self.target, rows, cells,
                                    [(pos, n) for (pos, _, _), n in zip(prompts, sizes)])]

    def room(self, rows: list[tuple[int, int]], cells: int, first_pos: int) -> int:
        """The prompt tokens a tick may carry beside decode `rows` ((position, 1) each), sized at the first
        prompt's position (prefill_room)."""
        return prefill_room(self.cost, self.target, self.max_prefill, rows, cells, first_pos)

    def cuts(self, room: int, prompts: list[tuple[int, int, int]], decoding: bool) -> list[int]:
        """The prompts' tokens in a tick with `room` (costmodel.fill: the tile rules hold on streams, where the
        chunks of each length are a call of their own; in deterministic mode costmodel.fill_deterministic)."""
        per_call = rows_per_call(self.cost) if self.streams else 0  # a prediction: the cost model refits if stale
        if self.deterministic:
            return fill_deterministic(room, prompts, decoding, per_call)
        return fill(room, [left for _, left, _ in prompts], decoding, self.streams, per_call)

    def predicted_ms(self, chunks: list, cells: int) -> float:
        """What the tick will take, by the cost model (0 before it can say): the front plans the next tick
        late in this one (TickPipeline.plan_ahead_at). A decode-only tick takes what ticks of its rows took,
        which needs no fit; others, the fit's prediction."""
        if not chunks:
            return 0.0
        ms = self.cost.measured_decode_ms(len(chunks)) if all(len(c.tokens) == 1 for c in chunks) else None
        if ms is None and self.cost.coef is not None:
            spans = [(c.pos, len(c.tokens)) for c in chunks]
            ms = self.cost.predict(shape(spans, cells), sized(spans))
        return ms or 0.0
