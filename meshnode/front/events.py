"""The scheduler's events as client frames: each session's text stream, and its one `done`.

A session's streamed pieces must add up to its final text, so each live
session has a TextStream that holds back an incomplete character; when the
session ends, whatever is held goes out in a last `tokens` event before the
`done`.
"""
from __future__ import annotations

from ipc import protocol as P
from meshnode.core.scheduler import Event
from meshnode.text.tokenizer import TextStream, Tokenizer


class Events:
    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.streams: dict = {}

    def opened(self, key) -> None:
        self.streams[key] = TextStream(self.tok)

    def frames(self, ev: Event) -> list[tuple[bytes, list[bytes], bool]]:
        """(client identity, frames, final) for one event: a `tokens` event is not final (a stalled
        client may lose it: its `done` carries every token), a `done` is."""
        ident, sid = ev.session.key
        if ev.kind == "tokens":
            stream = self.streams.get(ev.session.key)
            return [(ident, P.tokens(sid, ev.tokens, stream.feed(ev.tokens) if stream else ""), False)]
        out = []
        stream = self.streams.pop(ev.session.key, None)
        tail = stream.end() if stream else ""
        if tail:  # the end of an incomplete character: streamed pieces add up to done.text
            out.append((ident, P.tokens(sid, [], tail), False))
        s = ev.session
        out.append((ident, P.done(sid, ev.reason, s.generated, self.tok.decode(s.generated), s.usage(), ev.detail),
                    True))
        return out
