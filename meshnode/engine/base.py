"""What every engine shares: the plan contract's checks and each sequence's bookkeeping.

Every engine (llama.cpp, the numpy reference, the fake in tests) validates plans
through the same rule, so a bad plan is refused identically everywhere and never
reaches llama.cpp, where it could crash the process or silently decode garbage;
and each keeps the same per-sequence state (next position, sampling parameters),
released the same way. An engine supplies `_run` (compute the chunks, return
the sampled tokens or the sequences that lost their place) and `release_kv`.
"""
from __future__ import annotations

import time

import numpy as np

from meshnode.core.types import GREEDY, InvalidPlan, Plan, Sampling, SeqChunk, StepResult
from meshnode.engine.sampling import sample


def validate_plan(plan: Plan, *, n_vocab: int, n_seq_max: int, n_batch: int, n_ctx_seq: int,
                  next_pos: list[int], samplers: dict) -> None:
    """Raise InvalidPlan unless `plan` can run; `next_pos` is after the plan's releases."""
    if plan.n_tokens > n_batch:
        raise InvalidPlan(f"plan has {plan.n_tokens} tokens, more than n_batch={n_batch}")
    for s in plan.release:
        if not isinstance(s, (int, np.integer)) or not 0 <= s < n_seq_max:
            raise InvalidPlan(f"release of sequence id {s!r} outside [0, {n_seq_max})")
    seen = set()
    for c in plan.chunks:
        if not 0 <= c.seq_id < n_seq_max:
            raise InvalidPlan(f"sequence id {c.seq_id} outside [0, {n_seq_max})")
        if c.seq_id in seen:
            raise InvalidPlan(f"sequence {c.seq_id} appears twice in one plan")
        seen.add(c.seq_id)
        n = len(c.tokens)
        if n == 0:
            raise InvalidPlan(f"empty chunk for sequence {c.seq_id}")
        expect = 0 if c.seq_id in plan.release else next_pos[c.seq_id]
        if c.pos != expect:
            raise InvalidPlan(f"sequence {c.seq_id} chunk starts at pos {c.pos}, expected {expect}")
        if c.pos + n > n_ctx_seq:
            raise InvalidPlan(f"sequence {c.seq_id} would reach pos {c.pos + n} > context {n_ctx_seq}")
        toks = np.asarray(c.tokens)
        if toks.ndim != 1 or not np.issubdtype(toks.dtype, np.integer):
            raise InvalidPlan(f"sequence {c.seq_id} tokens are not a 1-d integer array")
        if toks.min() < 0 or toks.max() >= n_vocab:
            raise InvalidPlan(f"sequence {c.seq_id} has a token id outside [0, {n_vocab})")
        if c.draw >= 0 and c.sampling is None and c.pos > 0 and c.seq_id not in samplers:
            raise InvalidPlan(f"sequence {c.seq_id} asks for a sample but has no sampling parameters")
        if c.sampling is not None and c.sampling.temperature < 0:
            raise InvalidPlan(f"sequence {c.seq_id} has a negative temperature")


class Engine:
    """Subclasses set n_vocab, n_seq_max, n_batch, n_ctx_seq (and the rest of EngineInfo) before
    calling `_init_sequences`."""

    n_vocab: int
    n_seq_max: int
    n_batch: int
    n_ctx_seq: int

    def _init_sequences(self) -> None:
        self._next_pos = [0] * self.n_seq_max
        self._samplers: dict[int, Sampling] = {}

    def step(self, plan: Plan) -> StepResult:
        """Run one tick: validate, release, compute every chunk, sample where asked."""
        t0 = time.perf_counter()
        self.begin(plan)
        res = self._run(plan)
        self.end(plan, res)
        res.step_ms = (time.perf_counter() - t0) * 1e3
        return res

    def begin(self, plan: Plan) -> None:
        """The part of a step before any computing: checks, releases, new sequences' sampling."""
        validate_plan(plan, n_vocab=self.n_vocab, n_seq_max=self.n_seq_max, n_batch=self.n_batch,
                      n_ctx_seq=self.n_ctx_seq, next_pos=self._next_pos, samplers=self._samplers)
        for s in plan.release:
            self.release(int(s))
        for c in plan.chunks:
            if c.sampling is not None or c.pos == 0:
                self._samplers[c.seq_id] = c.sampling or GREEDY

    def end(self, plan: Plan, res: StepResult) -> None:
        """The part after: the chunks that ran advance their sequences; the ones that lost their
        place (a cache miss) are released."""
        missed = set(res.cache_miss)
        for c in plan.chunks:
            if c.seq_id in missed:
                self.release(c.seq_id)
            else:
                self._next_pos[c.seq_id] = c.pos + len(c.tokens)
        res.kv_cells = sum(self._next_pos)

    def sample(self, c: SeqChunk, logits: np.ndarray) -> int:
        return sample(logits, self._samplers[c.seq_id], c.draw)

    def release(self, seq_id: int) -> None:
        self.release_kv(seq_id)
        self._next_pos[seq_id] = 0
        self._samplers.pop(seq_id, None)

    def release_kv(self, seq_id: int) -> None:
        """Drop the sequence's cached state (the subclass's KV)."""

    def _run(self, plan: Plan) -> StepResult:
        raise NotImplementedError
