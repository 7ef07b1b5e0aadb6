"""Ticks planned and not answered yet, oldest first: the one record of them.

The front plans tick N+1 while the engine runs tick N (vLLM's async
scheduling, SGLang's overlap scheduler), so up to `depth` ticks are in flight
and answers come back in order. The scheduler pushes each tick it plans; the
engine link sends it and hands each answer back through `answer`. When the
engine refuses a tick, every tick already sent behind it was planned on top of
it: the engine refuses those too, so they are marked `discard` (their answers
are dropped) and the next tick sent carries `resync`, which ends the
engine's refusals (meshnode/engine/followups.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from meshnode.core.types import Plan, SeqChunk


@dataclass
class Tick:
    """A planned tick: the plan the engine runs, and the session each of its chunks belongs to."""

    t: int
    plan: Plan
    sessions: list = field(default_factory=list)  # one per plan.chunks entry, in order
    reused: list = field(default_factory=list)  # sessions that start on cached KV in this tick
    sent_at: float = 0.0
    resync: bool = False  # the first tick after a refusal: the engine starts over from it
    discard: bool = False  # planned on top of a refused tick: refused too, its answer dropped

    @property
    def chunks(self) -> list[tuple[object, SeqChunk]]:
        """(session, chunk) pairs."""
        return list(zip(self.sessions, self.plan.chunks))


class TickPipeline:
    def __init__(self, depth: int = 1):
        self.depth = depth
        self.ticks: deque[Tick] = deque()
        self._last_t = 0
        self._resync = False

    def __len__(self) -> int:
        return len(self.ticks)

    @property
    def full(self) -> bool:
        return len(self.ticks) >= self.depth

    def push(self, plan: Plan, sessions: list, reused: list | None = None) -> Tick:
        """`sessions`: whose each of `plan.chunks` is, in order."""
        self._last_t += 1
        tick = Tick(self._last_t, plan, sessions, reused or [], resync=self._resync)
        self._resync = False
        self.ticks.append(tick)
        return tick

    def answer(self, t: int) -> Tick | None:
        """The tick an answer for `t` belongs to, taken off the pipeline; None for an answer to
        nothing in flight (a dead incarnation's) or to a discarded tick."""
        if not self.ticks or self.ticks[0].t != t:
            return None
        tick = self.ticks.popleft()
        return None if tick.discard else tick

    def refused(self) -> list[Tick]:
        """The oldest answered tick was refused: the ticks behind it will be too. Returns them (their
        sessions roll back) and marks them discarded; the next tick pushed carries resync."""
        behind = [tk for tk in self.ticks if not tk.discard]
        for tk in behind:
            tk.discard = True
        self._resync = True
        return behind

    def clear(self) -> None:
        """The engine is gone, and every tick with it; a new engine needs no resync."""
        self.ticks.clear()
        self._resync = False
