"""A deterministic stand-in engine with the real contract, for tests and drills.

Its next token is a pure function of (sequence contents so far, draw), so it
behaves like a model (a session's output depends only on its own tokens) while
costing nothing; `corrupt` lets a test break one sequence on purpose to prove
that corruption detectors detect. It validates plans exactly like the real
engine, so the scheduler's plans are checked against the contract too.
"""
from __future__ import annotations

import time

import numpy as np

from meshnode.core.types import FatalEngineError, Plan, StepResult
from meshnode.engine.base import Engine


class FakeEngine(Engine):
    def __init__(self, n_vocab: int = 512, n_seq_max: int = 8, n_ctx: int = 4096, n_batch: int = 512,
                 n_ctx_seq: int | None = None, eos: int = 2, kv_bytes_per_token: int = 1024,
                 weight_bytes: int = 1 << 20, step_s: float = 0.0, corrupt=()):
        self.n_vocab, self.n_seq_max, self.n_ctx, self.n_batch = n_vocab, n_seq_max, n_ctx, n_batch
        self.n_ctx_seq = n_ctx_seq or n_ctx
        self.eos, self.kv_bytes_per_token, self.weight_bytes = eos, kv_bytes_per_token, weight_bytes
        self.eog = [eos]
        self.recipe_fingerprint = f"fake-{n_vocab}"
        self.step_s = step_s
        self.fail_next = False  # the next step raises a fatal error, as llama_decode rc < -1 would
        self.corrupt: set[int] = set(corrupt)  # sequence ids whose samples are deliberately wrong
        self.plans: list[Plan] = []
        self._hash = [0] * n_seq_max
        self._init_sequences()

    def _run(self, plan: Plan) -> StepResult:
        if self.fail_next:
            self.fail_next = False
            raise FatalEngineError("injected fatal engine error")
        self.plans.append(plan)
        res = StepResult()
        for c in plan.chunks:
            h = self._hash[c.seq_id]
            for t in np.asarray(c.tokens).tolist():
                h = (h * 1_000_003 + int(t) + 1) % (1 << 61)
            self._hash[c.seq_id] = h
            if c.draw >= 0:
                seed = self._samplers[c.seq_id].seed
                tok = (h ^ (seed * 7919) ^ c.draw) % (self.n_vocab - 3) + 3  # never a control token
                if c.seq_id in self.corrupt:
                    tok = 3 + (tok - 3 + 1) % (self.n_vocab - 3)
                res.tokens[c.seq_id] = tok
        if self.step_s:
            time.sleep(self.step_s)
        return res

    def release_kv(self, seq_id: int) -> None:
        self._hash[seq_id] = 0
