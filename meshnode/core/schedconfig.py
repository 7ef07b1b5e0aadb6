"""The scheduler's settings as one typed part (vLLM's SchedulerConfig). `NodeConfig.resolve()` derives it
from the node's settings and nothing else makes one up: no field has a default here, so a test or a
benchmark that builds a scheduler runs the node's policy unless it names what it changes
(`dataclasses.replace`)."""
from __future__ import annotations

from dataclasses import dataclass

from meshnode.core.sizing import TickTarget


@dataclass(frozen=True)
class SchedulerConfig:
    prefix_cache: str  # the prefix cache's scope: off, client, node (core/seqs.py)
    tick_target: TickTarget  # how long a tick with prompt rows may take while sessions decode
    gather_ms: float  # an idle engine's first tick waits until no request has come for this long
    kv_events: bool  # the prefix cache's blocks published as KV events (core/kvevents.py)
    policy: str  # the queue's order: fcfs or priority (core/priority.py)
    reserved_slots: int  # sequence slots kept for priorities better than 0
    steps_ms: float  # a decode-only tick's steps fit this (core/steps.py); 0: one step a tick
