"""What every engine shares: the plan contract's checks and each sequence's bookkeeping.

Every engine (llama.cpp, the numpy reference, the fake in tests) validates plans
through the same rule, so a bad plan is refused identically everywhere and never
reaches llama.cpp, where it could crash the process or silently decode garbage;
and each keeps the same per-sequence state (next position, sampling parameters),
released the same way. An engine supplies `_run` (compute the chunks, return
the sampled tokens or the sequences that lost their place) and `release_kv`,
`trim_kv` and `share_kv` (the prefix cache's operations on its KV).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import numpy as np

from meshnode.core.types import (GREEDY, Constrained, ConstraintFailed, InvalidPlan, Keep, Load, Plan, Release,
                                 Sampling, Save, SeqChunk, Share, StepResult)
from meshnode.engine.sampling import logprobs, sample

MAX_STEPS = 64  # the most steps one plan may ask for (Plan.steps)


def _kv_after(plan: Plan, n_seq_max: int, next_pos: list[int]) -> dict[int, int]:
    """Where the plan's releases and KV operations leave each sequence they touch; InvalidPlan for one that
    names a sequence outside the slots, or keeps or shares positions the sequence does not hold."""
    after: dict[int, int] = {}

    def seq(s, what: str) -> int:
        if not isinstance(s, (int, np.integer)) or not 0 <= s < n_seq_max:
            raise InvalidPlan(f"{what} of sequence id {s!r} outside [0, {n_seq_max})")
        return int(s)

    def pos(s: int) -> int:
        return after.get(s, next_pos[s])

    for s in plan.release:
        after[seq(s, "release")] = 0
    for op in plan.kv:
        if isinstance(op, Release):
            after[seq(op.seq_id, "release")] = 0
        elif isinstance(op, Keep):
            s = seq(op.seq_id, "keep")
            if not 0 <= op.n <= pos(s):
                raise InvalidPlan(f"keep of {op.n} positions of sequence {s}, which holds {pos(s)}")
            after[s] = op.n
        elif isinstance(op, Share):
            src, dst = seq(op.src, "share"), seq(op.dst, "share")
            if src == dst or pos(dst) != 0 or not 0 < op.n <= pos(src):
                raise InvalidPlan(f"share of {op.n} positions from sequence {src} ({pos(src)} held) into "
                                  f"{dst} ({pos(dst)} held): the source must hold them and the target be empty")
            after[dst] = op.n
        elif isinstance(op, Save):
            s = seq(op.seq_id, "save")
            if not (isinstance(op.path, str) and op.path) or not 0 < op.n <= pos(s):
                raise InvalidPlan(f"save of {op.n} positions of sequence {s}, which holds {pos(s)}, to {op.path!r}")
            after[s] = op.n
        elif isinstance(op, Load):
            s = seq(op.seq_id, "load")
            if not (isinstance(op.path, str) and op.path) or pos(s) != 0 or op.n < 1:
                raise InvalidPlan(f"load of {op.n} positions into sequence {s} ({pos(s)} held) from {op.path!r}: "
                                  "the target must be empty")
            after[s] = op.n
        else:
            raise InvalidPlan(f"unknown KV operation {op!r}")
    return after


def validate_plan(plan: Plan, *, n_vocab: int, n_seq_max: int, n_batch: int, n_ctx_seq: int,
                  next_pos: list[int], samplers: dict) -> None:
    """Raise InvalidPlan unless `plan` can run; `next_pos` and `samplers` are before the plan."""
    try:
        n_tokens = plan.n_tokens
    except TypeError:  # len() of a scalar
        raise InvalidPlan("a chunk's tokens are not a 1-d integer array") from None
    if n_tokens > n_batch:
        raise InvalidPlan(f"plan has {n_tokens} tokens, more than n_batch={n_batch}")
    steps = plan.steps
    if steps != 1:
        if not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise InvalidPlan(f"steps {steps!r} outside [1, {MAX_STEPS}]")
        if any(len(c.tokens) != 1 or c.draw < 0 for c in plan.chunks):
            raise InvalidPlan("a multi-step plan's chunks are one-token rows that sample")
    after = _kv_after(plan, n_seq_max, next_pos)  # where the release and kv ops leave a sequence
    # per chunk, the same checks in the fewest steps: this runs for every row, between two decodes
    fresh = after  # sequences the ops above restarted: their sampling parameters went with their old KV
    seen = set()
    for c in plan.chunks:
        s, p, toks = c.seq_id, c.pos, c.tokens
        if not 0 <= s < n_seq_max:
            raise InvalidPlan(f"sequence id {s} outside [0, {n_seq_max})")
        if s in seen:
            raise InvalidPlan(f"sequence {s} appears twice in one plan")
        seen.add(s)
        if type(toks) is not np.ndarray:
            toks = np.asarray(toks)
        if toks.ndim != 1 or toks.dtype.kind not in "iu":
            raise InvalidPlan(f"sequence {s} tokens are not a 1-d integer array")
        n = toks.shape[0]
        if n == 0:
            raise InvalidPlan(f"empty chunk for sequence {s}")
        expect = after[s] if s in after else next_pos[s]
        if p != expect:
            raise InvalidPlan(f"sequence {s} chunk starts at pos {p}, expected {expect}")
        if p + n + steps - 1 > n_ctx_seq:
            raise InvalidPlan(f"sequence {s} would reach pos {p + n + steps - 1} > context {n_ctx_seq}")
        # a decode row's one token is read as is, not through two reductions
        lo, hi = (toks.item(0),) * 2 if n == 1 else (toks.min(), toks.max())
        if lo < 0 or hi >= n_vocab:
            raise InvalidPlan(f"sequence {s} has a token id outside [0, {n_vocab})")
        sampling = c.sampling
        if sampling is None:
            if c.draw >= 0 and p > 0 and (s not in samplers or s in fresh):
                raise InvalidPlan(f"sequence {s} asks for a sample but has no sampling parameters")
        elif sampling.temperature < 0:
            raise InvalidPlan(f"sequence {s} has a negative temperature")


class Engine:
    """Subclasses set n_vocab, n_seq_max, n_batch, n_ctx_seq (and the rest of EngineInfo) before
    calling `_init_sequences`."""

    n_vocab: int
    n_seq_max: int
    n_batch: int
    n_ctx_seq: int

    def _init_sequences(self) -> None:
        self._next_pos = [0] * self.n_seq_max
        self._history: list[list[int]] = [[] for _ in range(self.n_seq_max)]  # tokens fed, by position
        self._samplers: dict[int, Sampling] = {}
        self._constraints: dict = {}  # seq -> engine/constraint.Constraint, for sessions with a response_format
        self._saved, self._unloaded = {}, set()  # the last plan's Save and failed Load outcomes
        self._hurried: Callable[[], bool] = lambda: False  # hurry_when's
        self._steps = 1  # the running plan's steps

    def hurry_when(self, hurried: Callable[[], bool]) -> None:
        """`hurried()` says the running tick is to leave undone the llama_decode calls it has not finished
        (StepResult.deferred; the worker asks the link: link.Hurry). Asked from llama.cpp's compute thread."""
        self._hurried = hurried

    def step(self, plan: Plan) -> StepResult:
        """Run one tick: validate, release, compute every chunk, sample where asked; a multi-step plan's rows
        again with their samples, `plan.steps` times in all."""
        self._steps = plan.steps  # a hurry stops a multi-step tick between steps, or undoes a step whole
        res = self.step_once(plan)
        return self._more_steps(plan, res) if plan.steps > 1 else res

    def step_once(self, plan: Plan) -> StepResult:
        t0 = time.perf_counter()
        self.begin(plan)
        saved, unloaded = self._saved, self._unloaded
        if unloaded:  # a Load that failed: its session's chunks cannot run, the others' do
            plan = replace(plan, chunks=[c for c in plan.chunks if c.seq_id not in unloaded])
        res = self._run(plan)
        res.saved, res.cache_miss = saved, [*res.cache_miss, *sorted(unloaded)]
        self.end(plan, res)
        res.step_ms = (time.perf_counter() - t0) * 1e3
        return res

    def _more_steps(self, plan: Plan, res: StepResult) -> StepResult:
        """Steps 2..plan.steps of a multi-step tick: each row that sampled decodes its sample at the next
        position with the next draw. A sequence that lost its KV or failed drops out; what it drew before
        stays in `earlier`; one that sampled a token that ends its session (Plan.ends) stops with it, its
        last sample kept as the tick's. A hurry stops it between steps, or inside a step the engine undoes
        whole (StepResult.deferred: LlamaEngine._deferrable): `steps` says how many ran."""
        rows, earlier, ran, ended = plan.chunks, {}, 1, {}
        for _ in range(1, plan.steps):
            for c in rows:
                if res.tokens.get(c.seq_id, -1) in plan.ends.get(c.seq_id, ()):
                    ended[c.seq_id] = (res.tokens[c.seq_id], res.logprobs.get(c.seq_id))
            rows = [c for c in rows if c.seq_id in res.tokens and c.seq_id not in ended]
            if not rows or self._hurried():  # hurried: the steps run so far are the tick (StepResult.steps)
                break
            for c in rows:
                earlier.setdefault(c.seq_id, []).append((res.tokens[c.seq_id], res.logprobs.get(c.seq_id)))
            rows = [SeqChunk(c.seq_id, c.pos + 1, np.array([res.tokens[c.seq_id]], np.int32), draw=c.draw + 1)
                    for c in rows]
            nxt = self.step_once(Plan(rows))
            if nxt.deferred:  # hurried inside this step, which left its rows as before it: the tick ran `ran`
                for c in rows:
                    earlier[c.seq_id].pop()
                    if not earlier[c.seq_id]:
                        del earlier[c.seq_id]
                break
            nxt.cache_miss = res.cache_miss + nxt.cache_miss
            nxt.failed = {**res.failed, **nxt.failed}
            nxt.step_ms += res.step_ms
            nxt.drafted += res.drafted
            nxt.served += res.served
            nxt.saved = res.saved
            res, ran = nxt, ran + 1
        for seq, (tok, lp) in ended.items():  # their last samples, the tick's for them as for the rest
            res.tokens[seq] = tok
            if lp is not None:
                res.logprobs[seq] = lp
        res.earlier, res.steps = earlier, ran
        return res

    def begin(self, plan: Plan) -> None:
        """The part of a step before any computing: checks, releases, new sequences' sampling."""
        validate_plan(plan, n_vocab=self.n_vocab, n_seq_max=self.n_seq_max, n_batch=self.n_batch,
                      n_ctx_seq=self.n_ctx_seq, next_pos=self._next_pos, samplers=self._samplers)
        for s in plan.release:
            self.release(int(s))
        self._saved, self._unloaded = {}, set()
        for op in plan.kv:
            if isinstance(op, Release):
                self.release(op.seq_id)
            elif isinstance(op, Save):
                self._saved[op.seq_id] = self._save_seq(op)
            elif isinstance(op, Load):
                self._load_seq(op)
            elif isinstance(op, Keep):
                self.trim_kv(op.seq_id, op.n)
                self._next_pos[op.seq_id] = op.n
                del self._history[op.seq_id][op.n:]
                self._samplers.pop(op.seq_id, None)
                self._constraints.pop(op.seq_id, None)
            else:
                self.share_kv(op.src, op.dst, op.n)
                self._next_pos[op.dst] = op.n
                self._history[op.dst] = self._history[op.src][:op.n]
        for c in plan.chunks:
            if c.sampling is not None or c.pos == 0:
                self._samplers[c.seq_id] = c.sampling or GREEDY
                self._constraints.pop(c.seq_id, None)
            if c.constraint is not None:
                self._constraints[c.seq_id] = self._start_constraint(c)

    def _save_seq(self, op: Save) -> int:
        """The sequence cut to its first n positions, then written with its tokens: the bytes written, 0 when
        the engine could not (its session leaves without its KV and is prefilled again where it goes)."""
        self.trim_kv(op.seq_id, op.n)
        self._next_pos[op.seq_id] = op.n
        del self._history[op.seq_id][op.n:]
        return self.save_kv(op.seq_id, op.path, self._history[op.seq_id])

    def _load_seq(self, op: Load) -> None:
        """The sequence starts with the saved KV's first n positions and the tokens saved with it; one that
        cannot be had is released and reported a miss (step_once)."""
        self.release(op.seq_id)
        tokens = self.load_kv(op.seq_id, op.path, op.n)
        if tokens is None or len(tokens) != op.n:
            self.release(op.seq_id)
            self._unloaded.add(op.seq_id)
            return
        self._next_pos[op.seq_id] = op.n
        self._history[op.seq_id] = list(tokens)

    def end(self, plan: Plan, res: StepResult) -> None:
        """The part after: the chunks that ran advance their sequences; the ones that lost their
        place (a cache miss) are released; deferred ones stay where they were."""
        missed, deferred = set(res.cache_miss), set(res.deferred)
        for c in plan.chunks:
            if c.seq_id in missed:
                self.release(c.seq_id)
            elif c.seq_id not in deferred:
                self._next_pos[c.seq_id] = c.pos + len(c.tokens)
                self._history[c.seq_id][c.pos:] = np.asarray(c.tokens).tolist()
        res.kv_cells = sum(self._next_pos)

    def _start_constraint(self, c: SeqChunk):
        """The chunk's matcher, or the library's words when it cannot build one: that session fails when it
        samples, never the tick (the other rows are other clients')."""
        try:
            return self.constraint(c.constraint)
        except ConstraintFailed as e:
            return e

    def sample(self, c: SeqChunk, logits: np.ndarray, res: StepResult) -> None:
        """The chunk's token into `res` (and its log-probabilities, when the session asked for them).
        Penalties see the sequence's tokens up to and including this chunk's. A response_format that fails
        here (the library's limits, no token allowed) fails its session alone, in `res.failed`."""
        s = self._samplers[c.seq_id]
        k = self._constraints.get(c.seq_id)
        history = self._history[c.seq_id][:c.pos] + list(c.tokens) if s.penalized or k else ()
        if k is not None:  # what it generated so far, the sample of the tick before included
            try:
                if isinstance(k, ConstraintFailed):
                    raise k
                logits = k.masked(logits, history)
            except ConstraintFailed as e:
                res.failed[c.seq_id] = f"response_format: {e}"
                return
        tok = res.tokens[c.seq_id] = sample(logits, s, c.draw, history)
        if s.logprobs:
            res.logprobs[c.seq_id] = logprobs(logits, tok, s.logprobs)

    def fed(self, seq: int) -> list[int]:
        """The sequence's tokens fed so far, by position: the engine's own list, not a copy."""
        return self._history[seq]

    def constrained(self, seq: int) -> bool:
        return seq in self._constraints

    def release(self, seq_id: int) -> None:
        self.release_kv(seq_id)
        self._next_pos[seq_id] = 0
        self._history[seq_id] = []
        self._samplers.pop(seq_id, None)
        self._constraints.pop(seq_id, None)

    def constraint(self, c: Constrained):
        """The engine's matcher for a compiled grammar (meshnode/engine/constraint.py); engines without a
        tokenizer for it refuse the plan."""
        raise InvalidPlan("this engine cannot constrain output")

    def release_kv(self, seq_id: int) -> None:
        """Drop the sequence's cached state (the subclass's KV)."""

    def trim_kv(self, seq_id: int, n: int) -> None:
        """Keep the sequence's first `n` positions and drop the rest."""
        raise NotImplementedError

    def share_kv(self, src: int, dst: int, n: int) -> None:
        """Give the empty sequence `dst` the first `n` positions of `src`."""
        raise NotImplementedError

    def save_kv(self, seq_id: int, path: str, tokens: list[int]) -> int:
        """Write the sequence's KV and its `tokens` to `path`; the bytes written, 0 when it cannot."""
        return 0

    def load_kv(self, seq_id: int, path: str, n: int) -> list[int] | None:
        """Give the empty sequence the first `n` positions a save_kv wrote to `path`; their tokens, or None
        when the file cannot be loaded or holds fewer."""
        return None

    def kv_sample(self, path: str) -> bool:
        """Before any session: write to `path` the state file of a one-token sequence, as save_kv writes them,
        and forget it; the worker learns from it what the front checks every imported KV against
        (ipc/seqstate.py `learn`). False where the engine writes none (no KV is imported then)."""
        return False

    def _run(self, plan: Plan) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the engine holds."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
