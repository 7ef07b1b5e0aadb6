"""Pipelined ticks on the engine's side: each follow-up token filled in from the tick before.

The front plans tick N+1 while the engine still runs tick N
(meshnode/core/pipeline.py). A sequence that samples in tick N then decodes in
tick N+1 with a token the front has not seen: its chunk is marked `follow`,
and Followups fills it in from tick N's result. Two things can break that
link, and both are handled here so that one bad tick never takes good
sequences with it:

- tick N lost a sequence's KV (llama_decode rc=1, a cache miss), or its session
  failed (its response_format could not go on): its chunks in
  tick N+1 are dropped and reported as misses again, unless N+1 released the
  sequence and starts a new session on it; a session N+1 meant to start on that
  KV (a `Keep` of it, or a `Share` from it) is dropped the same way, its KV
  operation with it;
- a multi-step tick N's row sampled a token that ends its session (Plan.ends; the row stopped there): its
  follow row in tick N+1, planned for all of N's steps, is dropped, unreported: its session has ended;
- tick N was refused (a bad plan): every later tick that was already queued
  was planned on top of it, so Followups refuses them all until the front,
  having rolled its own state back, sends a tick marked `resync`.
"""
from __future__ import annotations

from dataclasses import replace

from meshnode.core.types import InvalidPlan, Keep, Plan, Share, StepResult

AWAITING_RESYNC = "refused: an earlier tick failed and the front has not resynchronised yet"


class Followups:
    def __init__(self):
        self.sampled: dict[int, int] = {}  # seq_id -> token sampled in the last tick
        self.lost: set[int] = set()  # sequences whose KV the last tick lost
        self.ends: dict[int, frozenset[int]] = {}  # the last tick's Plan.ends: a row that sampled one has ended
        self.refusing = False

    def resolve(self, plan: Plan, resync: bool = False) -> tuple[Plan, list[int]]:
        """The plan an engine can run (every follow filled in), and the sequences dropped from it.

        Follow chunks are filled in place (their one token set, `follow` cleared): in the engine
        process the plan is its own copy, decoded from the link, and this runs between two decodes,
        where building new chunks cost more than the rest of the hand-over together.
        """
        if resync:
            self.refusing, self.sampled, self.lost, self.ends = False, {}, set(), {}
        if self.refusing:
            raise InvalidPlan(AWAITING_RESYNC)
        lost, gone = self.lost, set()
        if lost and plan.kv:  # reuse of KV that is gone: those sessions are lost too
            gone = {op.seq_id for op in plan.kv if isinstance(op, Keep) and op.seq_id in lost}
            gone |= {op.dst for op in plan.kv if isinstance(op, Share) and op.src in lost}
            if gone:
                kv = [op for op in plan.kv if not (isinstance(op, (Keep, Share)) and _target(op) in gone)]
                plan, lost = replace(plan, kv=kv), lost | gone
        restarted = plan.restarted
        dropped = [c.seq_id for c in plan.chunks if c.seq_id in lost and c.seq_id not in restarted] if lost else []
        dropped += sorted(gone - set(dropped))  # reported even without a chunk here: their session must end
        for c in plan.chunks:
            if c.follow and c.seq_id not in dropped:
                tok = self.sampled.get(c.seq_id)
                if tok is None or len(c.tokens) != 1 or c.seq_id in restarted:
                    raise InvalidPlan(f"sequence {c.seq_id} follows a sample the last tick did not draw")
                c.tokens[0], c.follow = tok, False
        if dropped:
            plan = replace(plan, chunks=[c for c in plan.chunks if c.seq_id not in dropped])
        return plan, dropped

    def run(self, engine, plan: Plan, resync: bool = False, hurried: bool = False) -> StepResult:
        """Run `plan` on `engine` right after the tick before it; dropped sequences come back as misses.
        `hurried`: the front asked this tick to hurry before it began (link.Hurry): only its KV operations
        run, its chunks come back deferred (planned again from where they were).

        A refusal (InvalidPlan, or any error the caller does not treat as fatal) must be followed
        by `refused()`.
        """
        deferred = [c.seq_id for c in plan.chunks] if hurried else []
        ended = [] if hurried or resync or not self.ends else self._ended(plan)
        if ended:
            plan = replace(plan, chunks=[c for c in plan.chunks if c.seq_id not in ended])
        runnable, dropped = self.resolve(replace(plan, chunks=[], steps=1) if hurried else plan, resync)
        res = engine.step(runnable)
        res.deferred += deferred
        res.ended = ended
        res.cache_miss = list(res.cache_miss) + dropped
        self.sampled, self.lost = dict(res.tokens), set(res.cache_miss) | set(res.failed)
        self.ends = runnable.ends
        return res

    def _ended(self, plan: Plan) -> list[int]:
        """The follow rows whose session ended on the token the tick before sampled for them (its Plan.ends)."""
        restarted = plan.restarted
        return [c.seq_id for c in plan.chunks if c.follow and c.seq_id not in restarted
                and self.sampled.get(c.seq_id, -1) in self.ends.get(c.seq_id, ())]

    def refused(self) -> None:
        """This tick was refused: refuse the queued ticks planned on top of it until a resync."""
        self.refusing, self.sampled, self.lost, self.ends = True, {}, set(), {}


def _target(op) -> int:
    return op.dst if isinstance(op, Share) else op.seq_id
