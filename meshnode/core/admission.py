"""Bounded admission: say yes, queue, or no (with a stable reason) at once.

A session reserves its whole KV need (prompt + max_tokens) and its scratch when
it becomes active and returns them when it ends, so a running session never
runs out of KV mid-generation; the sum of reservations never exceeds the budget.
Checks run cheapest and most permanent first: a request that can never fit is
refused as such (KV, context, scratch) rather than as a transient QUEUE_FULL.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshnode.core import reasons as R
from meshnode.core.budget import NodeBudget
from meshnode.core.session import Ask


@dataclass(frozen=True)
class AdmissionDecision:
    reason: str
    detail: str = ""
    displaced: tuple = ()  # the `done` events of queued sessions this one took the place of (priority policy)
    facts: dict | None = None  # the numbers behind a refusal, sent beside its detail (ipc/events.py rejected)

    @property
    def accepted(self) -> bool:
        return self.reason in (R.ADMITTED, R.QUEUED)


class Admission:
    def __init__(self, budget: NodeBudget, recipe: str | None = None, reserved: int = 0):
        """`reserved`: slots only a session of a priority better than 0 may take (the priority policy's
        headroom: such a session starts at once, without preempting anyone)."""
        self.budget = budget
        self.recipe = recipe
        self.reserved = reserved
        self.kv_reserved_bytes = 0
        self.scratch_reserved_bytes = 0
        self.n_active = 0

    def check(self, s: Ask, *, live: bool, queue_len: int, draining: bool,
              mem_available: int | None, engine_down: str | None = None) -> AdmissionDecision:
        """Decide for a new session; does not reserve anything. `engine_down`: why the engine is
        unusable (a crash loop), or None."""
        b = self.budget
        if draining:
            return AdmissionDecision(R.REJECTED_DRAINING, "the node is draining and takes no new sessions")
        if engine_down:
            return AdmissionDecision(R.REJECTED_ENGINE_UNAVAILABLE, f"engine unavailable: {engine_down}")
        if live:
            return AdmissionDecision(R.REJECTED_DUPLICATE, f"session id {s.key!r} is already live")
        if s.n_prompt < 1 or s.max_tokens < 1:
            return AdmissionDecision(R.REJECTED_BAD_REQUEST, "a session needs a non-empty prompt and max_tokens >= 1")
        if s.recipe is not None and s.recipe != self.recipe:
            return AdmissionDecision(R.REJECTED_RECIPE_MISMATCH,
                                     f"requested recipe {s.recipe!r}, this node serves {self.recipe!r}")
        never = self.never_fits(s)
        if never:
            return never
        if mem_available is not None and mem_available < b.memory_floor_bytes:
            return AdmissionDecision(R.REJECTED_MEMORY_PRESSURE,
                                     f"available memory {mem_available} is below the floor {b.memory_floor_bytes}")
        if queue_len == 0 and self.can_start(s):
            return AdmissionDecision(R.ADMITTED, "running")
        if queue_len < b.max_queue:
            return AdmissionDecision(R.QUEUED, f"queued at position {queue_len + 1}")
        return AdmissionDecision(R.REJECTED_QUEUE_FULL,
                                 f"queue is full ({b.max_queue} waiting); retry later or elsewhere")

    def never_fits(self, s: Ask) -> AdmissionDecision | None:
        """The refusal for a size this node can never take, whatever else it is running; else None."""
        b = self.budget
        if s.kv_tokens > b.n_ctx_seq:
            return AdmissionDecision(R.REJECTED_CONTEXT_TOO_LONG,
                                     f"prompt + max_tokens = {s.kv_tokens} exceeds the per-sequence "
                                     f"context of {b.n_ctx_seq}", facts={"n_prompt_tokens": s.n_prompt,
                                                                         "n_ctx": b.n_ctx_seq})
        if self.kv_need(s) > b.kv_budget_bytes:
            return AdmissionDecision(R.REJECTED_KV_BUDGET,
                                     f"needs {self.kv_need(s)} KV bytes, the node's budget is {b.kv_budget_bytes}")
        if self.scratch_need(s) > b.scratch_envelope_bytes:
            return AdmissionDecision(R.REJECTED_SCRATCH_BUDGET,
                                     f"needs {self.scratch_need(s)} scratch bytes, the envelope is "
                                     f"{b.scratch_envelope_bytes}")
        return None

    def kv_need(self, s: Ask) -> int:
        return s.kv_tokens * self.budget.kv_bytes_per_token

    def scratch_need(self, s: Ask) -> int:
        return self.budget.scratch_for(s.n_prompt, s.max_tokens)

    def can_start(self, s: Ask, without: list[Ask] = ()) -> bool:
        """`without`: as if those running sessions had released their reservations (preemption's question)."""
        b = self.budget
        return (self.n_active - len(without) < b.effective_active_cap - (self.reserved if s.priority >= 0 else 0)
                and self.kv_reserved_bytes - sum(map(self.kv_need, without)) + self.kv_need(s) <= b.kv_budget_bytes
                and self.scratch_reserved_bytes - sum(map(self.scratch_need, without)) + self.scratch_need(s)
                <= b.scratch_envelope_bytes)

    def reserve(self, s: Ask) -> None:
        self.n_active += 1
        self.kv_reserved_bytes += self.kv_need(s)
        self.scratch_reserved_bytes += self.scratch_need(s)

    def release(self, s: Ask) -> None:
        self.n_active -= 1
        self.kv_reserved_bytes -= self.kv_need(s)
        self.scratch_reserved_bytes -= self.scratch_need(s)
