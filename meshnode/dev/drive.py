"""Driving a scheduler and an engine in one process, in lockstep: tests and the overhead bench.

The node itself never does this (its ticks travel to the engine process); here
a tick is planned, run and applied in a row, with one tick in flight at most.
"""
from __future__ import annotations

from meshnode.core.scheduler import Event, Scheduler


def run_tick(sched: Scheduler, engine) -> list[Event]:
    tick = sched.plan()
    if tick is None:
        return []
    result = engine.step(tick.plan)
    return sched.apply(tick, result)


def run_to_completion(sched: Scheduler, engine, max_ticks: int = 100_000) -> list[Event]:
    """Tick until every session ends; bounded, so a misconfiguration cannot loop forever."""
    events: list[Event] = []
    for _ in range(max_ticks):
        if sched.idle:
            return events
        events += run_tick(sched, engine)
    if not sched.idle:
        raise RuntimeError(f"sessions still live after {max_ticks} ticks")
    return events
