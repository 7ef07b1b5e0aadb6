"""Draft tokens for the row deterministic mode adds beside a lone decode row.

A decode row alone in its run of streams gets a second row so that its matmuls take
the same kernel as in a crowd (engine/invariant.py). That row can be the sequence's
own next position instead of a dummy on another stream: a two-row chunk of generated
tokens, the shape a restart already re-prefills them in, with the same bits as two
decode rows. If the token sampled from the first row is the draft, the second row's
logits are the next tick's, computed already: the engine answers that tick from them
(engine/llama.py). The draft is prompt lookup: the token that followed the last time
the sequence's two latest tokens appeared in it. A wrong draft costs what the dummy
cost; text that repeats itself (code, quotes, lists, edits of a given text) is where
it pays. `Drafted` is LlamaEngine's part that does it (deterministic mode, streams).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from meshnode.core.types import SeqChunk, StepResult


class Ahead(NamedTuple):
    """A sequence's next tick, computed in this one from an accepted draft: the chunk it must be
    (one token at `pos`, `token`, draw `draw`) and what it sampled."""
    pos: int
    token: int
    draw: int
    sampled: int
    logprobs: tuple | None


class Drafts:
    """Per sequence, the token that last followed each pair of tokens, indexed as the history grows."""

    def __init__(self):
        self._next: dict[int, dict[tuple[int, int], int]] = {}
        self._upto: dict[int, int] = {}  # positions of the history indexed so far

    def propose(self, seq: int, history: list[int], pos: int, token: int) -> int:
        """The draft for position pos + 1, where `token` is the sequence's token at `pos` and `history`
        its tokens before it (at least `pos` of them); the token itself when the pair never came before."""
        index = self._next.setdefault(seq, {})
        upto = self._upto.get(seq, 0)
        for i in range(max(upto, 2), pos):
            index[(history[i - 2], history[i - 1])] = history[i]
        self._upto[seq] = max(upto, pos)
        return index.get((history[pos - 1], token), token) if pos >= 1 else token

    def forget(self, seq: int, keep: int = 0) -> None:
        """The sequence's history from position `keep` on was dropped or replaced: index it again."""
        if keep <= 0 or keep < self._upto.get(seq, 0):
            self._next.pop(seq, None)
            self._upto.pop(seq, None)


class Drafted:
    """The drafted row in an engine (engine/llama.py): its `_ids` (streams), `_history`, `_constraints`,
    `n_ctx_seq`, `sample`, `_logits` and `trim_kv` (which also drops a sequence's `_ahead`)."""

    def _init_drafts(self) -> None:
        self._drafts, self._ahead = Drafts(), {}  # sequence -> Ahead: its next tick, computed from a draft

    def _draft(self, chunks: list) -> dict[int, SeqChunk]:
        """Deterministic mode: each decode row alone in its run of streams goes with a draft of its next
        token, its own second row instead of a dummy on another stream (engine/drafts.py)."""
        rows = {self._ids[c.seq_id]: c for c in chunks if len(c.tokens) == 1}  # by stream
        out = {}
        for s, c in rows.items():
            if s - 1 in rows or s + 1 in rows or c.draw < 0 or c.pos + 1 >= self.n_ctx_seq \
                    or c.seq_id in self._constraints:
                continue
            t = int(c.tokens[0])
            d = self._drafts.propose(c.seq_id, self._history[c.seq_id], c.pos, t)
            out[c.seq_id] = SeqChunk(c.seq_id, c.pos, np.array([t, d], np.int32), draw=c.draw)
        return out

    def _verify(self, c: SeqChunk, row: int, res: StepResult) -> None:
        """A drafted row's token from its first row; where it is the draft, the next tick's from the second
        (kept for it, with its cell), else the draft's cell goes."""
        self.sample(SeqChunk(c.seq_id, c.pos, c.tokens[:1], draw=c.draw), self._logits(row - 1), res)
        res.drafted += 1
        if res.tokens[c.seq_id] != c.tokens[1]:
            self.trim_kv(c.seq_id, c.pos + 1)
            return
        ahead = StepResult()
        self.sample(SeqChunk(c.seq_id, c.pos, c.tokens, draw=c.draw + 1), self._logits(row), ahead)
        self._ahead[c.seq_id] = Ahead(c.pos + 1, int(c.tokens[1]), c.draw + 1, ahead.tokens[c.seq_id],
                                      ahead.logprobs.get(c.seq_id))

    def _answered(self, chunks: list, res: StepResult) -> list:
        """The chunks left to compute: one that is the tick a draft computed already is answered from it;
        a sequence that went elsewhere loses the draft's cell."""
        left = []
        for c in chunks:
            a = self._ahead.pop(c.seq_id, None)
            if a is not None and len(c.tokens) == 1 and (c.pos, int(c.tokens[0]), c.draw) == a[:3] \
                    and c.sampling is None:
                res.tokens[c.seq_id] = a.sampled
                if a.logprobs is not None:
                    res.logprobs[c.seq_id] = a.logprobs
                res.served += 1
                continue
            if a is not None:
                self.trim_kv(c.seq_id, a.pos)
            left.append(c)
        return left
