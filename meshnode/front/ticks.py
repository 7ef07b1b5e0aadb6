"""The tick driver: the one owner of the ticks in flight, from the scheduler's plan to the engine's answer.

The front's step is vLLM's (`EngineCore.step`: schedule, execute, update) with
the execution in another process: `due` says when the next plan is wanted, `send`
puts the scheduler's tick in flight, `reply` turns the engine's answer into the
tick and its result for the scheduler's `apply`. The pipeline (which ticks are
in flight and when the next is planned: meshnode/core/pipeline.py), the engine
link (meshnode/front/engine_link.py: the process and its socket) and the
telemetry each answer feeds are held here and nowhere else.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ipc import link
from meshnode.core.pipeline import Tick, TickPipeline
from meshnode.core.telemetry import Telemetry
from meshnode.core.types import Plan, StepResult
from meshnode.front.engine_link import EngineLink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reply:
    """A tick the engine ran, and its result (one object per llama_decode)."""

    tick: Tick
    result: StepResult
    mem_available: int | None  # the host's or cgroup's, as the engine measured it after the tick


@dataclass(frozen=True)
class Refusal:
    """The engine refused a tick (a plan it cannot run); it goes on serving the others. `behind`: the ticks
    planned on top of it, refused with it (their sessions are planned again)."""

    tick: Tick
    detail: str
    behind: list


def check_answer(res: StepResult, plan: Plan, n_vocab: int) -> None:
    """What the front checks of every answer before it applies it (ipc/link.py's checks): a sample for each row
    that asked one, but those the engine says drew none; a multi-step tick's earlier samples; embeddings.
    ValueError: the engine is broken."""
    link.check_samples(res.tokens, plan, n_vocab, {*res.cache_miss, *res.failed, *res.deferred, *res.ended})
    if plan.steps > 1 or res.steps != 1:
        link.check_earlier(res.earlier, plan, res.tokens, n_vocab, res.steps)
    if res.embeddings:
        link.check_embeddings(res.embeddings, plan)


def shape(plan: Plan, res: StepResult) -> str:
    """One tick's shape in a line, for the DEBUG log: what a slow tick held."""
    rows = [len(c.tokens) for c in plan.chunks]
    decode = sum(1 for n in rows if n == 1)
    return (f"{res.step_ms:.1f} ms: {decode} decode rows x {plan.steps} steps, {len(rows) - decode} chunks of "
            f"{sum(rows) - decode} tokens, {sum(c.constraint is not None for c in plan.chunks)} constrained, "
            f"{len(plan.kv)} kv ops, {len(res.deferred)} deferred")


class Ticks:
    def __init__(self, engine: EngineLink, depth: int, telemetry: Telemetry):
        self.engine, self.pipeline, self.telemetry = engine, TickPipeline(depth), telemetry

    @property
    def room(self) -> bool:
        """Another tick may go in flight now: not on top of a hurried one, whose chunks may come back undone
        (their sessions are planned again from where they were)."""
        return self.engine.can_send and not self.pipeline.full and not any(tk.hurried for tk in self.pipeline.ticks)

    @property
    def idle(self) -> bool:
        return not self.pipeline

    def due(self, gather_until: float) -> float:
        """When (monotonic s) to plan the next tick, 0 = now: late in the ticks in flight, so what arrives
        meanwhile joins it (TickPipeline.plan_ahead_at); on an idle engine, once the scheduler's gathering
        of a burst of requests ends (`gather_until`, Scheduler.gather_until)."""
        return self.pipeline.plan_ahead_at() if self.pipeline else gather_until

    def hurry(self) -> None:
        """A better first token waits (Scheduler.take_hurry) behind the ticks in flight: every one of them is
        asked to leave undone what it can (link.Hurry): one queued at the engine runs none of its chunks, the
        one running stops the llama_decode calls it has not finished; their chunks come back deferred and are
        planned again, and nothing goes in flight on top of them until they are answered (`room`).
        Not while one behind the first reads KV the ones before it were to compute (Plan.reads_kv: a prefix
        copied from a session still prefilling, a cached entry kept): those ops run in a hurried tick too."""
        ticks = self.pipeline.ticks
        if not ticks or ticks[-1].hurried or any(tk.plan.reads_kv for tk in list(ticks)[1:]):
            return
        for tk in ticks:
            tk.hurried = True
        self.engine.hurry(ticks[-1].t)

    def send(self, tick: Tick, fresh: bool = False) -> None:
        """In flight. `fresh`: sent to an engine that waited for clients, not for us: its wait is not
        counted as front + IPC cost."""
        self.pipeline.push(tick)
        self.engine.send(tick, fresh)
        self.pipeline.sent(tick, time.monotonic())  # after the send: a pause before it is not the engine's

    def reply(self) -> Reply | Refusal | None:
        """The engine's next message as a tick's outcome; None for anything else (a hello, an answer to a
        tick no longer in flight, or what breaks the engine: why_dead() reports that)."""
        msg = self.engine.receive()
        if msg is None:
            return None
        tick = self.pipeline.answer(msg.tick, time.monotonic())
        if tick is None:
            return None  # from before a restart, or behind a refused tick
        if isinstance(msg, link.TickRefused):
            return Refusal(tick, msg.detail, self.pipeline.refused())
        res = msg.result
        try:
            check_answer(res, tick.plan, self.engine.n_vocab)
        except ValueError as e:  # garbage from the engine: restart it, re-prefill
            self.engine.broke(f"engine sent a bad reply: {e}")
            return None
        self.engine.health.good_tick()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("tick %s", shape(tick.plan, res))
        self.telemetry.record_tick(msg.rss, res.step_ms, res.kv_cells, msg.gap_ms, res.drafted, res.served,
                                   len(res.deferred))
        self.telemetry.set_memory(msg.mem_available, msg.mem_total)
        self.pipeline.engine_waited(msg.gap_ms)
        return Reply(tick, res, msg.mem_available)

    def in_flight(self) -> list:
        """The ticks sent and not answered, oldest first."""
        return list(self.pipeline.ticks)

    def why_dead(self, now: float) -> str:
        return self.engine.why_dead(now, self.pipeline.ticks)

    def lost(self) -> None:
        """The engine died: every tick in flight died with it (its sessions are re-prefilled)."""
        self.pipeline.clear()
