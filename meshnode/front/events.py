"""The scheduler's events as client frames: each session's text stream, and its one `done`.

A session's streamed pieces must add up to its final text, so each live
session has a TextStream that holds back an incomplete character; when the
session ends, whatever is held goes out in a last `tokens` event before the
`done`. A session with stop strings also holds back text that could still become
one (meshnode/text/stops.py); when one matches, its text is cut before the match and
the caller ends the session with `STOP`: a formatter ends nothing itself.
"""
from __future__ import annotations

import time

from ipc import protocol as P
from meshnode.core import reasons as R
from meshnode.core.scheduler import Event
from meshnode.text.stops import StopText
from meshnode.text.tokenizer import TextStream, Tokenizer


class Events:
    def __init__(self, tok: Tokenizer, latency=None, clock=time.monotonic):
        """`latency`: told each gap between a session's tokens and each done's usage (front/prom.py)."""
        self.tok, self.latency, self.clock = tok, latency, clock
        self.streams: dict = {}
        self.stops: dict = {}
        self.last_token: dict = {}  # key -> when its last tokens went out

    def opened(self, key, stops: list[str] = ()) -> None:
        self.streams[key] = TextStream(self.tok)
        if stops:
            self.stops[key] = StopText(list(stops))

    def frames(self, ev: Event) -> tuple[list[tuple[bytes, list[bytes], bool]], bool]:
        """(client identity, frames, final) for one event: a `tokens` event is not final (a stalled
        client may lose it: its `done` carries every token), a `done` is; and whether a stop string
        matched (the session must end with STOP now)."""
        key = ev.session.key
        ident, sid = key
        if ev.kind == "tokens":
            if self.latency is not None:
                now, last = self.clock(), self.last_token.get(key)
                if last is not None:
                    self.latency.observe_gap(now - last)
                self.last_token[key] = now
            stream, stop = self.streams.get(key), self.stops.get(key)
            text = stream.feed(ev.tokens) if stream else ""
            hit = False
            if stop:
                text, hit = stop.feed(text)
            return [(ident, P.tokens(sid, ev.tokens, text, ev.logprobs), False)], hit
        out = []
        stream, stop = self.streams.pop(key, None), self.stops.pop(key, None)
        self.last_token.pop(key, None)
        tail = stream.end() if stream else ""
        if stop:
            tail = stop.end(tail)
        if tail:  # the end of an incomplete character: streamed pieces add up to done.text
            out.append((ident, P.tokens(sid, [], tail), False))
        s = ev.session
        text = stop.text if stop else self.tok.decode(s.generated)
        reason = R.STOP if stop and stop.matched else ev.reason  # the matching token was also its last
        usage = s.usage()
        if self.latency is not None:
            self.latency.observe_done(usage)
        incomplete = s.grammar is not None and reason != R.EOS  # cut before its output matched in full
        out.append((ident, P.done(sid, reason, s.generated, text, usage, ev.detail, incomplete), True))
        return out, False
