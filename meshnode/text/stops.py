"""Stop strings: a session ends where its decoded text first contains one, and no client sees past it.

Matching is on text, so a stop string split across tokens (or across the bytes of one
character) is still found. What is streamed is held back while the text's end could still
grow into a stop string, so a `tokens` event never shows text that a later match would cut.
"""
from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything decoded so far (cut at the match once one is found)
        self.sent = 0  # characters of it already streamed
        self.matched = False
        self.which = ""  # the stop string that matched (the first in the text; the longest where two begin there)

    def feed(self, piece: str) -> tuple[str, bool]:
        """New text -> (what may be streamed now, whether a stop string matched)."""
        self.text += piece
        start = max(0, self.sent - self.longest + 1)  # a match may begin in text held back, never earlier
        hits = [(i, -len(s), s) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i >= 0]
        if hits:
            at, _, self.which = min(hits)
            self.text, self.matched = self.text[:at], True
            return self._release(len(self.text)), True
        return self._release(len(self.text) - self._held()), False

    def end(self, tail: str = "") -> str:
        """The session ended: the rest of the text, held-back part included (nothing after a match)."""
        if self.matched:
            return ""
        self.text += tail
        return self._release(len(self.text))

    def _held(self) -> int:
        """The longest end of the text that is the start of a stop string (it may still become one)."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out
