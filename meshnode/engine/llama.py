"""The llama.cpp batch engine: one model, one context, a tick in as few llama_decode calls as it can.

Every decoding sequence's next token goes into ONE llama_decode, so the weights
are read once for all of them; that is where continuous batching gets its
throughput. On a unified KV the tick's prompt chunks ride in the same call; on
per-sequence streams (the default) llama.cpp cuts a batch into ubatches of
consecutive streams with equal token counts, so the prompt chunks of each length
are a call of their own (`_groups`, from core/costmodel.py's `llama_calls`,
which the cost model counts too), through the context's one `Batch` (engine/batch.py).
"""
from __future__ import annotations

import os

import numpy as np

from meshnode.core.costmodel import llama_calls
from meshnode.core.speculation import RowCost, in_effect as spec_in_effect
from meshnode.core.types import FatalEngineError, InvalidPlan, Plan, StepResult
from meshnode.engine import calibration, devices, invariant, llamacpp
from meshnode.engine.base import Engine
from meshnode.engine.batch import Batch
from meshnode.engine.config import EngineConfig
from meshnode.engine.drafts import Speculator
from meshnode.engine.embeddings import Pools
from meshnode.engine.llamacpp import FLASH_ATTN, KV_TYPES
from meshnode.engine.seqkv import SeqKV
from meshnode.engine.seqmap import SeqMap


# a sequence with a chunk in this tick or one of the LIVE_STEPS - 1 before it is live (kept on the streams beside
# the others): a session the front skips for a tick or two (more decoding than max_batch) stays, and a finished
# one whose stream the prefix cache keeps leaves the block a few ticks on
LIVE_STEPS = 4
HURRIED = "hurried"  # _decode's answer for a call the hurry stopped


class LlamaEngine(Engine):
    def __init__(self, cfg: EngineConfig):
        import llama_cpp as lc

        cfg.validate()
        llamacpp.install_log()
        self.cfg, self._lc = cfg, lc
        # deterministic_problem: why the mode is off where it was left to the engine ("" when on or turned off)
        self.deterministic = cfg.wants_deterministic
        left = cfg.deterministic is None
        self.deterministic_problem = (cfg.deterministic_problem or cfg.deterministic_cost) if left else ""
        if self.deterministic and cfg.weight_types & invariant.K_QUANTS:
            os.environ.setdefault(*invariant.TILED_ENV)  # read once, when llama.cpp first needs it
        if self.deterministic and llamacpp.split_kv_switch():
            os.environ.setdefault(*invariant.SPLIT_OFF_ENV)
        threads = self._load(cfg)
        self.kv = SeqKV(lc, self._ctx)
        placement = llamacpp.placement_lines()
        self.devices, self.kernels = self._placement.placed(placement), llamacpp.kernels(placement)
        vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        self.eos = lc.llama_vocab_eos(vocab)
        # every end-of-generation token (EOS, EOT, ...): one pass over the vocab at load
        self.eog = sorted(t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(vocab, t))
        self.n_seq_max = lc.llama_n_seq_max(self._ctx)
        self.n_batch = lc.llama_n_batch(self._ctx)
        self.n_ctx = lc.llama_n_ctx(self._ctx)
        self.n_ctx_seq = min(lc.llama_n_ctx_seq(self._ctx), lc.llama_model_n_ctx_train(self._model))
        self.weight_bytes = int(lc.llama_model_size(self._model))
        n_layer = lc.llama_model_n_layer(self._model)
        self.n_embd = lc.llama_model_n_embd(self._model)
        head_dim = self.n_embd // lc.llama_model_n_head(self._model)
        row = lc.llama_model_n_head_kv(self._model) * head_dim
        k, v = KV_TYPES[cfg.type_k], KV_TYPES[cfg.type_v]
        self.kv_bytes_per_token = n_layer * (llamacpp.row_bytes(row, k) + llamacpp.row_bytes(row, v))
        self._init_sequences()
        self._pools = Pools()  # embedding sessions' rows, pooled as they come (engine/embeddings.py)
        self._ids = SeqMap(self.n_seq_max) if cfg.kv_layout == "streams" else None
        self._ran: dict[int, int] = {}  # sequence -> the step of its last chunk (streams: who is live)
        self._step_no = 0
        spec = spec_in_effect(cfg.spec, cfg.kv_layout)[0]
        drafter = None
        if cfg.draft_model and spec != "off":
            from meshnode.engine.draftmodel import DraftModel

            drafter = DraftModel(cfg.draft_model, vocab, self.n_seq_max, self.n_ctx_seq, threads)
        self.drafts = Speculator(self, spec, cfg.draft_max, cfg.draft_min, drafter, streams=self._ids is not None)
        self._every_row: dict = {}  # this tick's drafted chunks, by sequence: each of their rows is an output
        # llama.cpp asks it between graph nodes of a deferrable call (_decode); kept here: ctypes holds a weak pointer
        self._abort_cb = lc.ggml_abort_callback(lambda _: bool(self._hurried()))
        self._no_abort = lc.ggml_abort_callback()  # NULL: none
        self._rows = 0  # rows the tick computed (padding included): what it cost is RowCost's to learn
        self._stoppable = True  # the running step's calls may be left undone by a hurry (_deferrable)
        self._b = Batch(lc, self._ctx, self.n_batch, self.n_vocab)
        # which lone decode rows get a dummy neighbour (engine/invariant.py): as the start-up check finds
        self.lone_pads = invariant.LonePads(False, False)
        if self.deterministic:
            self._check_deterministic()
        self.recipe_fingerprint = cfg.recipe(self.deterministic, devices.fingerprint(self.devices))
        self._matchers = None  # llguidance over this model's vocab: `matchers_source`'s, asked at the first constraint
        self.matchers_source = self.build_matchers  # the process shell's waits on a thread that builds it early

    def _load(self, cfg: EngineConfig) -> int:
        """The model where the device settings put it, and its context; the threads it runs on."""
        lc = self._lc
        mp = lc.llama_model_default_params()
        self._placement = devices.offload(mp, cfg.rpc, cfg.gpu_layers, cfg.tensor_split, cfg.devices)
        mp.use_extra_bufts = cfg.extra_buffers
        self._model = llamacpp.load_model(cfg.model_path, mp)
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = cfg.n_ctx, cfg.n_batch, cfg.n_batch
        if cfg.kv_layout == "streams":  # a stream past the trained context holds cells no position can reach
            cp.n_ctx = min(cfg.n_ctx, cfg.n_seq_max * lc.llama_model_n_ctx_train(self._model))
        cp.n_seq_max, cp.kv_unified = cfg.n_seq_max, cfg.kv_layout == "unified"
        threads = cfg.threads
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k, cp.type_v = KV_TYPES[cfg.type_k], KV_TYPES[cfg.type_v]
        cp.no_perf = True
        cp.flash_attn_type = FLASH_ATTN[cfg.flash]
        llamacpp.new_context(self, cp)
        return threads

    def kv_sample(self, path: str) -> bool:
        p = 0  # llama.cpp's own sequence 0, before the front has any: cleared after
        try:
            self._b.n = self._b.put(0, [self.eos], 0, p)
            return self._b.decode() == 0 and self.kv.save(p, path, [self.eos]) > 0
        finally:
            self._b.n = 0
            self.kv.clear()

    def _check_deterministic(self) -> None:
        """The start-up self-check (engine/invariant.py): where a row's bits move with its neighbours, the
        mode is off with the reason, or, where it was required, the engine refuses to start."""
        cfg = self.cfg
        expected = invariant.expected_pads(cfg.weight_types, cfg.type_k, cfg.type_v,
                                           cfg.amx_weights and cfg.weight_types == {"F16"}, cfg.threads,
                                           os.environ.get(invariant.SPLIT_OFF_ENV[0]) == "0")
        problem, pads = invariant.self_check(self, expected)
        if not problem and pads and cfg.deterministic is None:  # the default runs the mode only where it is free
            where = "every token" if pads.shallow else f"every token past {invariant.SPLIT_KV_CELLS}"
            self.deterministic_problem = (f"deterministic: off by default: the start-up check found that a session "
                                          f"decoding alone would pay a padding row {where} on this CPU and model; "
                                          "--deterministic requires it anyway (docs/determinism.md)")
            self.deterministic = False
        elif problem:
            if invariant.promised(cfg.weight_types, llamacpp.system_info()):
                problem += ("; the mode is promised on this CPU and model (docs/determinism.md): a regression "
                            "of this build, please report it")
            self.deterministic_problem = f"deterministic: not on this CPU and model: {problem}"
            self.deterministic = False
            if cfg.deterministic is True:
                self.close()
                raise FatalEngineError(f"{self.deterministic_problem}; serve without it (--no-deterministic)")

    def build_matchers(self):
        """llguidance's tokenizer reads every token of the vocabulary: a quarter of a second on a 49k one."""
        from meshnode.engine.constraint import Matchers

        return Matchers(llamacpp.constraint_tokenizer(self._lc.llama_model_get_vocab(self._model)), self.n_vocab)

    def constraint(self, c):
        if self._matchers is None:
            self._matchers = self.matchers_source()
        return self._matchers.start(c)

    def _groups(self, chunks: list) -> list[list]:
        """The llama_decode calls a tick takes (core/costmodel.py, llama_calls, which the tick cost model
        counts too); on streams each call's chunks ordered by stream, so that consecutive ones are one ubatch.
        Embedding chunks go in calls of their own (their rows are all outputs: engine/embeddings.py)."""
        unified = self.cfg.kv_layout == "unified"
        embed = [c for c in chunks if c.embed]
        calls = llama_calls([c for c in chunks if not c.embed] if embed else chunks, lambda c: len(c.tokens), unified)
        calls += llama_calls(embed, lambda c: len(c.tokens), unified) if embed else []
        if self._ids is not None:
            for call in calls:
                call.sort(key=lambda c: self._ids[c.seq_id])
        return calls

    def step_once(self, plan: Plan) -> StepResult:
        self._rows = 0
        res = super().step_once(plan)
        if res.served == len(plan.chunks) and res.served:  # nothing computed: no tick for the cost model
            res.step_ms = 0.0
        elif self._rows and not res.deferred and all(len(c.tokens) == 1 for c in plan.chunks):  # decode rows only
            self.drafts.row_cost.observe(self._rows, res.step_ms)
        return res

    def _run(self, plan: Plan) -> StepResult:
        res = StepResult()
        chunks = self.drafts.answered(plan.chunks, res) if self.drafts.ahead else plan.chunks
        drafts = self.drafts.plan(chunks)
        self._every_row = drafts
        calls = self._groups([drafts.get(c.seq_id, c) for c in chunks] if drafts else chunks)
        self._stoppable = self._steps == 1 or (len(calls) == 1 and not drafts)  # a later step: whole, or not at all
        for call in calls:
            rows = HURRIED if self._deferrable(call) and self._hurried() else self._decode(call)
            if rows is HURRIED:  # left undone (StepResult.deferred): their cells are cut back to before them
                for c in call:
                    self.trim_kv(c.seq_id, c.pos)
                res.deferred += [c.seq_id for c in call]
                continue
            if rows is None:  # no KV slot: llama.cpp rolled this call back; its sequences lost their place
                res.cache_miss += [c.seq_id for c in call]
                continue
            self._rows += self._b.n
            if call[0].embed:
                self._embedded(call, rows, res)
                continue
            for c, r in zip(call, rows):  # read before the next call overwrites the logits
                if drafts.get(c.seq_id) is c:
                    self.drafts.verify(c, r + 1 - len(c.tokens), res)
                elif c.draw >= 0:
                    self.sample(c, self.row_logits(r), res)
        self.drafts.observe(res)
        return res

    def _deferrable(self, call: list) -> bool:
        """A call a hurried tick may leave undone (stopped, or not begun), where ticks may be hurried at all
        (EngineConfig.hurry): on streams, where no other sequence's cells move with its own; not an embedding's
        (its pooled rows would be lost); in a multi-step tick, only a step of one call with no drafts, so that a
        stopped step is undone whole and the tick is the steps before it (Engine._more_steps)."""
        return self.cfg.hurry and self._ids is not None and self._stoppable and not call[0].embed

    def _embedded(self, call: list, rows: list[int], res: StepResult) -> None:
        """An embedding call's rows into their sessions' pools; the vector of each chunk that asks for it."""
        n = self._b.n
        out = np.ctypeslib.as_array(self._lc.llama_get_embeddings(self._ctx), shape=(n, self.n_embd))
        for c, r in zip(call, rows):
            self._pools.add(c.seq_id, out[r + 1 - len(c.tokens):r + 1], c.pos == 0)
            if c.draw >= 0:
                res.embeddings[c.seq_id] = self._pools.take(c.seq_id, c.embed)

    def pad_rows(self, chunks: list) -> int:
        """Deterministic mode's padding rows for these decode rows (engine/invariant.py)."""
        if not (self.deterministic and self.lone_pads and self._ids is not None):
            return 0
        rows = [(self._ids[c.seq_id], c.pos) for c in chunks if len(c.tokens) == 1]
        return len(invariant.pads(rows, self.n_seq_max, self.lone_pads))

    def calibrate(self) -> tuple:
        """Ticks of known shapes, timed, before the first client (meshnode/engine/calibration.py); the ones
        of one call are what drafting starts from (core/speculation.py, RowCost)."""
        spec, self.drafts.mode = self.drafts.mode, "off"  # the shapes as they are, no drafts beside them
        try:
            out = calibration.calibrate(self)
        finally:
            self.drafts.mode = spec
        self.drafts.row_cost = RowCost((rows, ms) for calls, rows, *_, sized, ms in out if calls == 1 and not sized)
        return out

    def logits_for(self, plan: Plan) -> dict[int, np.ndarray]:
        """Run a plan and return copies of each sampled sequence's logits (tests, the oracle check)."""
        self.begin(plan)
        out = {}
        for chunks in self._groups(plan.chunks):
            rows = self._decode(chunks)
            if rows is None:
                raise FatalEngineError("no KV slot for the plan")
            out.update({c.seq_id: self.row_logits(r).copy() for c, r in zip(chunks, rows) if c.draw >= 0})
        self.end(plan, StepResult())
        return out

    def _decode(self, chunks: list) -> list[int] | None:
        """The chunks as ONE llama_decode: each chunk's last batch row, or None when there was no KV slot."""
        if not chunks:
            return []
        rows = self._fill(chunks)
        embed = bool(chunks[0].embed)  # a call of embedding chunks: every row an output (embeddings.py)
        dummies = self._even(chunks, rows) if self.deterministic and not embed else []
        hurry = self._deferrable(chunks)
        if embed:
            self._lc.llama_set_embeddings(self._ctx, True)
        if hurry:
            self._lc.llama_set_abort_callback(self._ctx, self._abort_cb, None)
        try:
            rc = self._b.decode()
        finally:
            if embed:
                self._lc.llama_set_embeddings(self._ctx, False)
            if hurry:
                self._lc.llama_set_abort_callback(self._ctx, self._no_abort, None)
        for s, p in dummies:
            self.kv.drop(s, p)
        if rc == 2 and hurry:  # llama.cpp stopped it and removed the stopped ubatch's cells
            return HURRIED
        if rc == 1:
            return None
        if rc == -1:
            raise InvalidPlan("llama_decode rejected the batch as invalid (rc=-1)")
        if rc != 0:
            raise FatalEngineError(f"llama_decode failed with rc={rc}")
        return rows

    def _fill(self, chunks: list) -> list[int]:
        """Copy every chunk into the batch; return each chunk's last row."""
        b, i, rows = self._b, 0, []
        for c in chunks:
            n = len(c.tokens)
            i = b.put(i, c.tokens, c.pos, self._phys(c.seq_id))
            b.want[i - 1] = 1 if c.draw >= 0 else 0
            if self._every_row.get(c.seq_id) is c or c.embed:  # drafted or embedding: every row is an output
                b.want[i - n:i] = 1
            rows.append(i - 1)
        b.n = i
        return rows

    def _even(self, chunks: list, rows: list[int]) -> list[tuple[int, int]]:
        """Deterministic mode: no ubatch of one row, none with one output row (engine/invariant.py). Rows
        move to their streams' order and `rows` follows them; returns the dummy rows' (stream, pos) to remove."""
        b = self._b
        n = b.n
        if len(chunks[0].tokens) > 1:  # prompt chunks of one length, in their own call on streams: 0 or 2 outputs each
            for c, r in zip(chunks, rows):
                if c.draw >= 0:
                    b.want[r - 1] = 1
            return []
        b.want[:n] = 1
        dummies = []
        placed = list(zip(b.seq[:n].tolist(), b.pos[:n].tolist())) if self.lone_pads else ()
        for s in invariant.pads(placed, self.n_seq_max, self.lone_pads) if placed else ():
            p = self.kv.positions(s)
            k = n + len(dummies)
            b.tok[k], b.pos[k], b.seq[k], b.want[k] = b.tok[0], p, s, 1
            dummies.append((s, p))
        if dummies:
            m = n + len(dummies)
            order = np.argsort(b.seq[:m], kind="stable")
            for a in (b.tok, b.pos, b.seq, b.want):
                a[:m] = a[:m][order]
            where = np.empty(m, np.int64)
            where[order] = np.arange(m)
            rows[:] = [int(where[r]) for r in rows]
            b.n = m
        return dummies

    def row_logits(self, row: int) -> np.ndarray:
        return self._b.logits(row)

    def _phys(self, seq_id: int) -> int:
        return seq_id if self._ids is None else self._ids[seq_id]

    def begin(self, plan: Plan) -> None:
        """Releases first, then the live sequences' streams are brought together (meshnode/engine/seqmap.py):
        those with a chunk in this tick or one of the LIVE_STEPS before it."""
        super().begin(plan)
        if self._ids is not None and plan.chunks:  # a move is copied at the next decode: never left pending
            self._step_no += 1
            for c in plan.chunks:
                self._ran[c.seq_id] = self._step_no
            live = [s for s, t in self._ran.items() if self._step_no - t < LIVE_STEPS]
            if len(live) < len(self._ran):
                self._ran = {s: self._ran[s] for s in live}
            for src, dst in self._ids.arrange(live):
                self.kv.copy(src, dst)  # copied at the next decode
                self.kv.drop(src)

    def release_kv(self, seq_id: int) -> None:
        self._ran.pop(seq_id, None)
        self.drafts.forget(seq_id)
        self._pools.forget(seq_id)
        p = seq_id if self._ids is None else self._ids.drop(seq_id)
        if p is not None:
            self.kv.drop(p)

    def trim_kv(self, seq_id: int, n: int) -> None:
        self.drafts.forget(seq_id, n)  # kept drafts' cells are past n: a Keep keeps no more than the sequence holds
        p = seq_id if self._ids is None else self._ids.get(seq_id)
        if p is not None:
            self.kv.drop(p, n)

    def share_kv(self, src: int, dst: int, n: int) -> None:
        """Unified: `dst` joins the cells of `src`'s first n positions (no data moves). Streams: llama.cpp
        copies only whole streams (at the next decode), so the copy is trimmed after."""
        if self._ids is None:
            self.kv.copy(src, dst, n)
            return
        ps, pd = self._ids.get(src), self._ids[dst]
        self.kv.copy(ps, pd)
        self.kv.drop(pd, n)

    def save_kv(self, seq_id: int, path: str, tokens: list[int]) -> int:
        p = seq_id if self._ids is None else self._ids.get(seq_id)
        return 0 if p is None else self.kv.save(p, path, tokens)

    def load_kv(self, seq_id: int, path: str, n: int) -> list[int] | None:
        """llama.cpp checks the file's format and that its cells fit; the positions it holds are checked here."""
        p = seq_id if self._ids is None else self._ids[seq_id]
        tokens = self.kv.load(p, path, self.n_ctx_seq)
        if tokens is None or len(tokens) < n or self.kv.positions(p) < n or self.kv.first(p) != 0:
            return None
        self.kv.drop(p, n)
        return tokens[:n]

    def seq_pos_max(self, seq_id: int) -> int:
        p = seq_id if self._ids is None else self._ids.get(seq_id)
        return -1 if p is None else self.kv.positions(p) - 1

    def state_seq_size(self, seq_id: int) -> int:
        p = seq_id if self._ids is None else self._ids.get(seq_id)
        return 0 if p is None else self.kv.state_bytes(p)

    def close(self) -> None:
        if getattr(self, "drafts", None) is not None:
            self.drafts.close()
        llamacpp.free(self)
