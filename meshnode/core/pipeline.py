"""Ticks planned and not answered yet, oldest first: the one record of them.

The front plans tick N+1 while the engine runs tick N (vLLM's async
scheduling, SGLang's overlap scheduler), so up to `depth` ticks are in flight
and answers come back in order. It plans it late in tick N, though, not as
soon as N is sent (`plan_ahead_at`): a request that arrives during N then
joins N+1 instead of waiting behind it for N+2, and N+1 is still queued at
the engine when N ends. Its one owner is the tick driver
(meshnode/front/ticks.py): it pushes each tick the scheduler plans as it sends
it, and takes each answer off through `answer`. When the
engine refuses a tick, every tick already sent behind it was planned on top of
it: the engine refuses those too, so they are marked `discard` (their answers
are dropped) and the next tick sent carries `resync`, which ends the
engine's refusals (meshnode/engine/followups.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from meshnode.core.types import Plan, SeqChunk

# the next tick is planned at least this long before the ticks in flight are predicted to end (the front's
# planning and the link take ~1 ms here; a tick ends up to ~10 % before its prediction), and longer where
# the engine still waited for one (the front busy with many sessions' events): WAITED_MS is a wait that
# says so, against the ~0.1 ms hand-over every tick has
PLAN_LEAD_MS, PLAN_LEAD_SHARE, MAX_LEAD_MS, WAITED_MS = 2.0, 0.2, 50.0, 0.3


@dataclass
class Tick:
    """A planned tick: the plan the engine runs, and the session each of its chunks belongs to."""

    t: int
    plan: Plan
    sessions: list = field(default_factory=list)  # one per plan.chunks entry, in order
    reused: list = field(default_factory=list)  # sessions that start on cached KV in this tick
    exports: list = field(default_factory=list)  # sessions leaving the node whose KV this tick saves
    sent_at: float = 0.0
    started_at: float = 0.0  # when the engine began it, as the front can tell: sent to it idle, or the answer before
    predicted_ms: float = 0.0  # what the cost model expects it to take; 0 before it can say
    resync: bool = False  # the first tick after a refusal: the engine starts over from it
    discard: bool = False  # planned on top of a refused tick: refused too, its answer dropped
    planned: int = 0  # the scheduler's plan count when it was planned: a session preempted since is not its any more
    hurried: bool = False  # asked to leave undone what it can (Ticks.hurry): nothing is planned on top of it

    @property
    def chunks(self) -> list[tuple[object, SeqChunk]]:
        """(session, chunk) pairs."""
        return list(zip(self.sessions, self.plan.chunks))


class TickPipeline:
    def __init__(self, depth: int):
        self.depth = depth
        self.ticks: deque[Tick] = deque()
        self._last_t = 0
        self._resync = False
        self.lead_ms = PLAN_LEAD_MS

    def __len__(self) -> int:
        return len(self.ticks)

    @property
    def full(self) -> bool:
        return len(self.ticks) >= self.depth

    def plan_ahead_at(self) -> float:
        """When (monotonic s) to plan the next tick: so late that what arrives while the ticks in flight
        run joins it, so early that it is queued before they end. 0 (now) while none is in flight, or
        while one's time is unknown."""
        if not self.ticks or not all(tk.predicted_ms for tk in self.ticks):
            return 0.0
        ms = sum(tk.predicted_ms for tk in self.ticks)
        return self.ticks[0].started_at + max(0.0, ms - max(self.lead_ms, PLAN_LEAD_SHARE * ms)) / 1e3

    def engine_waited(self, gap_ms: float) -> None:
        """The engine's wait before a tick it answered (TickDone.gap_ms; < 0 after an idle spell): one
        that came late moves the next plans earlier; while none does, they creep back later."""
        if gap_ms > WAITED_MS:
            self.lead_ms = min(MAX_LEAD_MS, self.lead_ms + 2 * gap_ms)
        elif gap_ms >= 0:
            self.lead_ms = max(PLAN_LEAD_MS, self.lead_ms * 0.99)

    def push(self, tick: Tick) -> Tick:
        """`tick` (as the scheduler planned it) in flight: numbered, and the first after a refusal marked resync."""
        self._last_t += 1
        tick.t, tick.resync = self._last_t, self._resync
        self._resync = False
        self.ticks.append(tick)
        return tick

    def sent(self, tick: Tick, now: float) -> None:
        """`tick` went to the engine at `now`; sent to an idle one (nothing before it in flight), it starts then."""
        tick.sent_at = now
        if self.ticks and self.ticks[0] is tick:
            tick.started_at = now

    def answer(self, t: int, now: float = 0.0) -> Tick | None:
        """The tick an answer for `t` belongs to, taken off the pipeline; None for an answer to
        nothing in flight (a dead incarnation's) or to a discarded tick. The next tick in flight runs
        from `now` (the engine had it queued)."""
        if not self.ticks or self.ticks[0].t != t:
            return None
        tick = self.ticks.popleft()
        if self.ticks:
            self.ticks[0].started_at = now
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
