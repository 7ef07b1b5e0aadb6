"""A draft model in the engine process: a second, smaller llama.cpp context that proposes the drafts.

llama-server's `-md`: a model with the same tokenizer guesses the next K tokens of every drafting sequence,
the target verifies them as rows of its own tick (engine/drafts.py), so the output is the target's whatever
the draft says. Its context mirrors the target's sequences: each sequence's cells hold the tokens the
target confirmed (`synced` of them); a proposal first feeds what the target confirmed since (its prompt,
the first time), then decodes K tokens greedily, all drafting sequences in one llama_decode a step. What
the target did not keep is cut before the next proposal. A draft whose vocab differs from the target's
cannot propose the target's tokens: refused at start, in one line.
"""
from __future__ import annotations

import time

import numpy as np

from meshnode.core.types import FatalEngineError
from meshnode.engine import llamacpp
from meshnode.engine.batch import Batch
from meshnode.engine.seqkv import SeqKV

MAX_CELLS = 16384  # the draft's KV, shared by all sequences: where it is full, drafts stop until it is cleared
BATCH = 512  # rows of one draft llama_decode: a long prompt is fed in several


class DraftModel:
    def __init__(self, path: str, target_vocab, n_seq_max: int, n_ctx_seq: int, threads: int):
        import llama_cpp as lc

        self._lc = lc
        mp = lc.llama_model_default_params()
        self._model = llamacpp.load_model(path, mp, "draft_model: ")
        why = llamacpp.vocab_difference(lc.llama_model_get_vocab(self._model), target_vocab)
        if why:
            self.close()
            raise FatalEngineError(llamacpp.cannot_draft(path, why))
        cp = lc.llama_context_default_params()
        cp.n_seq_max, cp.kv_unified = n_seq_max, True
        cp.n_ctx = min(n_seq_max * n_ctx_seq, MAX_CELLS)
        cp.n_batch = cp.n_ubatch = min(cp.n_ctx, BATCH)
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        llamacpp.new_context(self, cp, "draft_model: ")
        self.kv = SeqKV(lc, self._ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self._cap = cp.n_batch
        self._batch = Batch(lc, self._ctx, self._cap, self.n_vocab)
        self.synced: dict[int, int] = {}  # sequence -> its first positions the draft context holds
        self.step_ms = 0.0  # what the last proposal's decodes took, per drafted token (the cost model's price)

    def propose(self, seqs: dict[int, list[int]], k: int) -> dict[int, list[int]]:
        """k greedy drafts to follow each sequence's confirmed tokens; {} where the context cannot take them."""
        t0 = time.perf_counter()
        backlog = {}
        for s, toks in seqs.items():
            have = min(self.synced.get(s, 0), len(toks) - 1)  # at least the last token is fed: its logits
            self.kv.drop(s, have)
            backlog[s] = (have, toks[have:])
        nxt: dict[int, int] = {}
        while backlog:  # a long prompt's first feed takes several calls
            feed, room = {}, self._cap
            for s, (p, rest) in list(backlog.items()):
                if room == 0:
                    break
                piece = rest[:room]
                feed[s], room = (p, piece, len(piece) == len(rest)), room - len(piece)
                del backlog[s]
                if len(piece) < len(rest):
                    backlog[s] = (p + len(piece), rest[len(piece):])
            got = self._decode(feed)
            if got is None:
                self.forget_all()
                return {}
            nxt |= got
        out = {s: [t] for s, t in nxt.items()}
        pos = {s: len(toks) for s, toks in seqs.items()}
        for _ in range(k - 1):
            got = self._decode({s: (pos[s], [out[s][-1]], True) for s in seqs})
            if got is None:
                self.forget_all()
                return {}
            for s, t in got.items():
                out[s].append(t)
            pos = {s: p + 1 for s, p in pos.items()}
        for s, toks in seqs.items():
            self.synced[s] = len(toks)  # the drafts' cells are cut at the next proposal
        self.step_ms = (time.perf_counter() - t0) * 1e3 / max(1, k)
        return out

    def _decode(self, feeds: dict) -> dict[int, int] | None:
        """One llama_decode of each sequence's tokens from its position ({seq: (pos, tokens, last)}); the
        greedy next token of each whose feed is `last`; None where llama.cpp could not take the call."""
        b, i, rows = self._batch, 0, {}
        for s, (pos, toks, last) in feeds.items():
            i = b.put(i, toks, pos, s)
            if last:
                b.want[i - 1] = 1
                rows[s] = i - 1
        b.n = i
        if b.decode() != 0:
            return None
        return {s: int(np.argmax(b.logits(r))) for s, r in rows.items()}

    def forget(self, seq: int, keep: int = 0) -> None:
        """The target's sequence kept its first `keep` positions (0: released)."""
        if seq in self.synced:
            self.synced[seq] = min(self.synced[seq], keep)
            self.kv.drop(seq, keep)

    def forget_all(self) -> None:
        self.synced.clear()
        self.kv.clear()

    def close(self) -> None:
        llamacpp.free(self)
