"""The output stage: each session's events become its client's frames, and every finish is decided once.

vLLM's output processor is the model. The scheduler decides the finishes it
must know before the next plan (EOS, stop tokens, length, and its own: cancel,
drain, engine errors); what needs the text or the client is decided here: a
stop string (the text is cut before it), a client that stopped reading or
vanished (its sessions end, each with its `done`, kept until it reads again:
outbox.py). `process` sends what the events say and returns the sessions the
scheduler must end for those reasons; their `done` went out here already, so
the scheduler's own `done` for them is not sent again, and nothing loops back.

A session's streamed pieces add up to its final text: its TextStream holds back
an incomplete character, its StopText the text that could still become a stop
string (meshnode/text/stops.py); at the end whatever is held goes out in a last
`tokens` frame before the `done`. The latency stamps (gaps between tokens, the
finish time) are taken here, where the frames leave.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ipc import events as E
from ipc.transport import CLIENT_HWM
from meshnode.core import reasons as R
from meshnode.core.scheduler import Event
from meshnode.core.session import DONE
from meshnode.front.outbox import GONE, STALLED
from meshnode.text.stops import StopText
from meshnode.text.tokenizer import TextStream, Tokenizer

log = logging.getLogger("meshnode.front")


@dataclass
class Stream:
    """One live session's output: what it has streamed and what it holds back."""

    session: object  # core.session.Session
    text: TextStream
    stop: StopText | None = None
    last_token: float | None = None  # when its last tokens went out


@dataclass(frozen=True)
class Finish:
    """A session ended here: the scheduler releases it (its `done` is already out)."""

    key: tuple
    reason: str


@dataclass
class Output:
    tok: Tokenizer
    send: object  # (ident, frames, final) -> outbox outcome: Clients.send
    telemetry: object  # counts the clients that stopped reading or vanished with sessions live
    latency: object = None  # told each gap between a session's tokens and each done's usage (front/prom.py)
    export: object = None  # (exported event, stop strings) -> its frames (front/moves.py)
    relays: object = lambda key: False  # a handoff carries the session on: its `done` EXPORTED is not its client's
    moved: dict = field(default_factory=dict)  # key -> Stream of a session a handoff relays (front/handoff.py)
    exporting: dict = field(default_factory=dict)  # key -> its done's frames, held until its KV's frames are out
    clock: object = time.monotonic
    streams: dict = field(default_factory=dict)  # key -> Stream, from admission to done

    def opened(self, session, stops: list[str] = ()) -> None:
        out = Stream(session, TextStream(self.tok), StopText(list(stops)) if stops else None)
        if session.generated:  # an import: its text so far went to the client from the node it left
            text = out.text.feed(session.generated)
            if out.stop:
                out.stop.feed(text)  # what it streamed, and holds back the same
        self.streams[session.key] = out

    def stops_of(self, key) -> list[str]:
        out = self.streams.get(key)
        return list(out.stop.stops) if out is not None and out.stop else []

    def process(self, events: list[Event]) -> list[Finish]:
        """Send each event's frames; the sessions ended here (stop strings, stalled or gone clients)."""
        finishes: list[Finish] = []
        for ev in events:
            if ev.kind == "tokens":
                self._tokens(ev, finishes)
            elif ev.kind == "exported":  # its `done` follows (or came first, when it ended before the export)
                out = self.export(ev, self.stops_of(ev.session.key))
                if out is None:  # its KV is being read off the loop: its done waits for it (export_ready)
                    self.exporting[ev.session.key] = []
                for frames in out or ():
                    self._deliver(ev.session.key[0], frames, True, finishes)
            elif ev.kind == "progress":
                key, (total, cache, processed) = ev.session.key, ev.progress
                if key in self.streams:
                    ms = (self.clock() - ev.session.t_submit) * 1e3
                    self._deliver(key[0], E.progress(key[1], total, cache, processed, ms), False, finishes)
            elif ev.kind == "embedding":
                key = ev.session.key
                self._deliver(key[0], E.embedding(key[1], ev.embedding, len(ev.session.prompt)), False, finishes)
            elif ev.session.key in self.streams:  # not ended here already (a stop string on its last token)
                self._done(ev.session.key, ev.reason, ev.detail, finishes)
        return finishes

    def answer(self, ident: bytes, frames: list[bytes]) -> list[Finish]:
        """A request's final answer to its client (admitted, rejected, status, ...)."""
        finishes: list[Finish] = []
        self._deliver(ident, frames, True, finishes)
        return finishes

    def _tokens(self, ev: Event, finishes: list[Finish]) -> None:
        key = ev.session.key
        out = self.streams.get(key)
        if out is None:
            return  # ended here while its tick ran
        if self.latency is not None:
            now = self.clock()
            if out.last_token is not None:
                self.latency.observe_gap(now - out.last_token)
            out.last_token = now
        text = out.text.feed(ev.tokens)
        hit = False
        if out.stop:
            text, hit = out.stop.feed(text)
        self._deliver(key[0], E.tokens(key[1], ev.tokens, text, ev.logprobs), False, finishes)
        if hit and key in self.streams:
            self._done(key, R.STOP, "", finishes)
            finishes.append(Finish(key, R.STOP))

    def _done(self, key, reason: str, detail: str, finishes: list[Finish]) -> None:
        """The last `tokens` (what was held back) and the `done`; the session's stream ends."""
        if reason == R.EXPORTED and self.relays(key):  # it goes on at a drain's peer (front/handoff.py)
            self.moved[key] = self.streams.pop(key)
            return
        if key in self.exporting:  # after its state and KV (export_ready)
            self.exporting[key] = self._last_frames(key, reason, detail)
            return
        for frames in self._last_frames(key, reason, detail):
            self._deliver(key[0], frames, True, finishes)

    def end_moved(self, key, reason: str, detail: str, relayed: list[int]) -> None:
        """A session a handoff took ends here after all (the peer refused it, or did not end it in time), with
        the tokens the peer generated for it; what this node held back is flushed only if there were none."""
        out = self.moved.pop(key, None)
        if out is None:
            return
        out.session.tokens += relayed
        self.streams[key] = out
        for frames in self._last_frames(key, reason, detail, flush=not relayed):
            self._deliver(key[0], frames, True, [])

    def export_ready(self, key, frames: list[list[bytes]]) -> list[Finish]:
        """An export's state and KV are read (front/moves.py): they go out, then its held `done`."""
        finishes: list[Finish] = []
        for f in frames + self.exporting.pop(key, []):
            self._deliver(key[0], f, True, finishes)
        return finishes

    def forget_moved(self, key) -> None:
        self.moved.pop(key, None)

    def _last_frames(self, key, reason: str, detail: str, flush: bool = True) -> list[list[bytes]]:
        out = self.streams.pop(key)
        s = out.session
        s.t_done = s.t_done or self.clock()
        tail = ""
        if reason != R.EXPORTED and flush:  # an exported session's held-back text is streamed where it goes
            tail = out.text.end()
            if out.stop:
                tail = out.stop.end(tail)
        frames = [E.tokens(s.key[1], [], tail)] if tail else []  # streamed pieces add up to done.text
        text = out.stop.text if out.stop and flush else self.tok.decode(s.generated)
        usage = s.usage()
        if self.latency is not None:
            self.latency.observe_done(usage)
        incomplete = s.grammar is not None and reason != R.EOS  # cut before its output matched in full
        stop = out.stop.which if out.stop and reason == R.STOP else ""
        return frames + [E.done(s.key[1], reason, s.generated, text, usage, detail, incomplete, stop)]

    def _deliver(self, ident: bytes, frames: list[bytes], final: bool, finishes: list[Finish]) -> None:
        """Send to one client. One that stopped reading or vanished loses its sessions, nobody else does;
        each still gets its `done`, kept until it reads again (outbox.py)."""
        outcome = self.send(ident, frames, final)
        if outcome not in (STALLED, GONE):
            return
        # the scheduler's own ends (an EOS in this same batch) keep their reason: their `done` follows
        mine = [key for key, out in self.streams.items() if key[0] == ident and out.session.state != DONE]
        if not mine:
            return
        why = "stopped reading" if outcome == STALLED else "disconnected"
        log.warning("client %s %s: cancelling its %d session(s)", ident.hex(), why, len(mine))
        self.telemetry.client_faults_total += 1
        detail = f"the client {why}" + (f" (over {CLIENT_HWM} messages unread)" if outcome == STALLED else "")
        ended = [(key, self._last_frames(key, R.CANCELLED, detail)) for key in mine]
        for key, frames_list in ended:  # every stream ended first: these sends cannot end them again
            for frames in frames_list:
                self.send(ident, frames, True)
            finishes.append(Finish(key, R.CANCELLED))
