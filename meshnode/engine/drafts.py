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
it pays.
"""
from __future__ import annotations

from typing import NamedTuple


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
