"""The engine contract: one tick's plan in, one result out.

Every engine (llama.cpp, the numpy reference, the fakes in tests) takes the same
`Plan` and returns the same `StepResult`, and validates plans through the same
`validate_plan`, so a bad plan is refused identically everywhere and never
reaches llama.cpp, where it could crash the process or silently decode garbage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class EngineError(Exception):
    """Base of engine failures; `fatal` ones mean the context can no longer be trusted."""

    fatal = False


class InvalidPlan(EngineError):
    """The plan broke the contract (bad token, position, sequence id, size)."""


class FatalEngineError(EngineError):
    """llama_decode returned < -1, or the engine is otherwise unusable: restart it."""

    fatal = True


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def as_list(self) -> list:
        return [self.temperature, self.top_k, self.top_p, self.seed]

    @classmethod
    def from_list(cls, v) -> "Sampling":
        return cls(float(v[0]), int(v[1]), float(v[2]), int(v[3]))


GREEDY = Sampling()


@dataclass
class SeqChunk:
    """Tokens for one sequence at positions pos .. pos+len-1 in this tick.

    `draw` >= 0 asks for a token to be sampled from the chunk's last row, using
    the session's `draw`-th random number (the index of the token generated);
    -1 means no sample (a middle prompt chunk). `sampling` rides on the
    sequence's first chunk (pos 0; None there means greedy); the engine
    remembers it until the sequence is released.

    `follow` marks a one-token chunk whose token is the one this sequence
    sampled in the tick before, which the front has not seen yet when it
    plans one tick ahead (its token here is -1); the engine process fills it
    in (meshnode/engine/chain.py) before any engine sees the plan.
    """

    seq_id: int
    pos: int
    tokens: np.ndarray
    draw: int = -1
    sampling: Sampling | None = None
    follow: bool = False


@dataclass
class Plan:
    chunks: list[SeqChunk] = field(default_factory=list)
    release: list[int] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


@dataclass
class StepResult:
    tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled token
    cache_miss: list[int] = field(default_factory=list)  # sequences whose KV was lost
    step_ms: float = 0.0
    kv_cells: int = 0  # KV cells in use after the step


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
