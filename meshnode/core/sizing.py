"""How much one tick carries and what it will take: the scheduler's questions to the tick cost model.

Decode rows come first and are never cut; the prompt tokens beside them are sized
so the tick stays within the node's tick target (costmodel.prefill_room, then
within_target for the chunks as cut), in the cuts the engine computes fastest and,
in deterministic mode, in the tiles a cold run computes (costmodel.fill,
fill_deterministic). The cost model learns from every answered tick (Scheduler.apply).
"""
from __future__ import annotations

from meshnode.core.costmodel import (TickCost, TickTarget, fill, fill_deterministic, prefill_room, rows_per_call, shape,
                                     sized, within_target)


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
        prompt's position (costmodel.prefill_room)."""
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
