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

from ipc import seqstate
from meshnode.core.types import FatalEngineError, Plan, StepResult
from meshnode.engine.base import Engine


def extend(h: int, token: int) -> int:
    """The fake's whole model: a rolling hash of the sequence's tokens."""
    return (h * 1_000_003 + int(token) + 1) % (1 << 61)


def _pause_until(end: float) -> None:
    """Return at `end` (time.perf_counter), to the microsecond: time.sleep alone oversleeps by 50-100 us
    here, which a benchmark of the node's own cost per tick would count as the node's. Sleep most of it,
    spin the end."""
    if end - time.perf_counter() > 1e-3:
        time.sleep(end - time.perf_counter() - 1e-3)
    while time.perf_counter() < end:
        pass


class FakeEngine(Engine):
    def __init__(self, n_vocab: int = 512, n_seq_max: int = 8, n_ctx: int = 4096, n_batch: int = 512,
                 n_ctx_seq: int | None = None, eos: int = 2, kv_bytes_per_token: int = 1024,
                 weight_bytes: int = 1 << 20, step_s: float = 0.0, corrupt=(), cost_ms=None):
        """`step_s`: what computing a plan takes (as llama_decode and sampling would), 0 for nothing."""
        self.n_vocab, self.n_seq_max, self.n_ctx, self.n_batch = n_vocab, n_seq_max, n_ctx, n_batch
        self.n_ctx_seq = n_ctx_seq or n_ctx
        self.eos, self.kv_bytes_per_token, self.weight_bytes = eos, kv_bytes_per_token, weight_bytes
        self.eog = [eos]
        self.recipe_fingerprint = f"fake-{n_vocab}"
        self.step_s = step_s
        self.cost_ms = cost_ms  # plan -> the time a step of it takes, for tests of what is sized by it
        self.fail_next = False  # the next step raises a fatal error, as llama_decode rc < -1 would
        self.corrupt: set[int] = set(corrupt)  # sequence ids whose samples are deliberately wrong
        self.plans: list[Plan] = []
        self._hashes: list[list[int]] = [[] for _ in range(n_seq_max)]  # after each position
        self._init_sequences()

    def _run(self, plan: Plan) -> StepResult:
        if self.fail_next:
            self.fail_next = False
            raise FatalEngineError("injected fatal engine error")
        self.plans.append(plan)
        start = time.perf_counter()
        res = StepResult()
        for c in plan.chunks:
            hs = self._hashes[c.seq_id]
            h = hs[-1] if hs else 0
            for t in np.asarray(c.tokens).tolist():
                h = extend(h, t)
                hs.append(h)
            if c.draw >= 0 and c.embed:  # an embedding: a unit vector of the sequence's contents
                v = np.random.default_rng(h).standard_normal(8)
                res.embeddings[c.seq_id] = (v / np.linalg.norm(v)).tolist()
            elif c.draw >= 0:
                tok = self.token(h, self._samplers[c.seq_id].seed, c.draw)
                if c.seq_id in self.corrupt:
                    tok = 3 + (tok - 3 + 1) % (self.n_vocab - 3)
                res.tokens[c.seq_id] = tok
        if self.step_s:  # the step_s include the stand-in model's hashing: it is no part of the node
            _pause_until(start + self.step_s)
        return res

    def step(self, plan: Plan) -> StepResult:
        res = super().step(plan)
        if self.cost_ms is not None:  # each step of a multi-step plan costs what the plan's first did
            res.step_ms = float(self.cost_ms(plan)) * res.steps
        return res

    def token(self, h: int, seed: int, draw: int) -> int:
        return (h ^ (seed * 7919) ^ draw) % (self.n_vocab - 3) + 3  # never a control token

    def expected(self, tokens: list[int], n_prompt: int, seed: int = 0) -> bool:
        """Whether tokens[n_prompt:] are what this engine gives a cold run of tokens[:n_prompt]: the
        check that reused, restarted or moved KV changed nothing."""
        h = 0
        for i, t in enumerate(tokens):
            if i >= n_prompt and t != self.token(h, seed, i - n_prompt):
                return False
            h = extend(h, t)
        return True

    def release_kv(self, seq_id: int) -> None:
        self._hashes[seq_id] = []

    def trim_kv(self, seq_id: int, n: int) -> None:
        del self._hashes[seq_id][n:]

    def share_kv(self, src: int, dst: int, n: int) -> None:
        self._hashes[dst] = self._hashes[src][:n]

    # its "KV" in llama.cpp's own state format, so the front's checks (ipc/seqstate.py) run on it as on
    # llama.cpp's: one layer whose K row is a position's rolling hash in four 16-bit f32 values, V a zero
    layout = seqstate.Layout(1, False, ((0, 16),), ((0, 4, 0),))

    def kv_sample(self, path: str) -> bool:
        self._hashes[0] = [extend(0, self.eos)]
        try:
            return self.save_kv(0, path, [self.eos]) > 0
        finally:
            self._hashes[0] = []

    def save_kv(self, seq_id: int, path: str, tokens: list[int]) -> int:
        hashes = np.asarray(self._hashes[seq_id][:len(tokens)], np.uint64)
        keys = np.stack([(hashes >> np.uint64(16 * i)) & np.uint64(0xFFFF) for i in range(4)], 1).astype("<f4")
        parsed = seqstate.Parsed(list(tokens), [keys.tobytes()], [np.zeros(len(tokens), "<f4").tobytes()])
        return seqstate.write(path, self.layout, parsed)

    def load_kv(self, seq_id: int, path: str, n: int) -> list[int] | None:
        """The files it is given are the front's (seqstate.canonical): read as such, any other refused."""
        try:
            with open(path, "rb") as f:
                data = f.read()
            tokens = seqstate.tokens_of(data)
            parsed = seqstate.parse(data, self.layout, tokens, self.n_seq_max)
        except (OSError, ValueError):
            return None
        if len(tokens) < n:
            return None
        k = np.frombuffer(parsed.keys[0], "<f4").reshape(-1, 4).astype(np.uint64)
        self._hashes[seq_id] = [int(sum(int(x) << (16 * i) for i, x in enumerate(row))) for row in k[:n]]
        return tokens[:n]
