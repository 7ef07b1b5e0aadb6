"""A drain that hands over (`handoff`): sessions still live when a drain begins go to a peer node with their KV,
and their clients' streams go on through this node until each ends there.

Without it a drain gives live sessions `drain_timeout_s` and ends the rest
DRAINED. With `--handoff ENDPOINT`, the drain exports every live session at once
(core/moves.py: a running one after the ticks in flight land, with its KV) and
imports it on the peer as a client of it; the peer's `tokens` and `done` for it
are relayed to the session's own client under its own id, so that client sees
one stream, none of it lost or repeated, and no second `admitted`. This node's
engine is idle meanwhile and the node exits when the last relayed session ends
or the drain's time is up. A session the peer refuses (its queue, another
recipe) or that cannot move (a response_format, an embedding) ends here as it
would have without a peer: DRAINED, its held-back text flushed by the output
stage. At the drain's deadline, relayed sessions still running are cancelled on
the peer and their clients get `done` DRAINED with every token they were sent.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import zmq

from ipc import protocol as P
from ipc import events as E
from ipc import moving as M
from ipc.transport import client_dealer
from meshnode.core import reasons as R

log = logging.getLogger("meshnode.front")


@dataclass
class Route:
    """A session relayed from the peer: whose it is here, and what its client has been sent."""

    key: tuple  # (client identity, id) here
    relayed: list[int] = field(default_factory=list)  # the tokens the peer generated for it, relayed
    cut: bool = False  # cancelled on the peer at the drain's deadline


class Handoff:
    def __init__(self, zctx: zmq.Context, peer: str, send, end_here, ended, n_vocab: int):
        """`send(ident, frames, final)`: to a client (Clients.send); `end_here(key, reason, detail, relayed)`: the
        output stage ends a session the peer would not take or did not finish, as a drain without a peer would
        (Output.end_moved); `ended(key)`: the peer's `done` went to its client (Output.forget_moved)."""
        self.peer, self.send, self.end_here, self.ended, self.n_vocab = peer, send, end_here, ended, n_vocab
        self.sock = client_dealer(zctx, peer)
        self.leaving: set = set()  # keys exported for the peer, their state not sent yet
        self.routes: dict[str, Route] = {}  # the peer's id -> the session here
        self._ids = itertools.count()
        self.moved = self.refused = self.malformed = 0

    @property
    def active(self) -> bool:
        return bool(self.leaving or self.routes)

    def take(self, sched, path) -> list:
        """The drain begins: every live session that can move leaves for the peer (`path()`: a file for its KV);
        the events of those that leave at once."""
        events = []
        for s in list(sched.live.values()):
            if s.grammar is None and not s.embed and not s.export_to:
                self.leaving.add(s.key)
                events += sched.export(s.key, path())
        return events

    def carries(self, ev, state) -> bool:
        """A leaving session's `exported` event: whether it is the handoff's (then its client hears nothing of
        it); `state()` gives its state and KV's bytes, which go to the peer."""
        key = ev.session.key
        if key not in self.leaving:
            return False
        self.leaving.discard(key)
        if not ev.reason:  # one that ended here first had its own done
            self.go(key, *state())
        return True

    def go(self, key: tuple, state: dict, data: bytes) -> None:
        """A leaving session's state is ready: import it on the peer, its KV after it."""
        pid = f"handoff-{next(self._ids)}"
        self.routes[pid] = Route(key)
        self.sock.send_multipart(M.import_request(pid, state))
        for frames in M.kv_requests(pid, data):
            self.sock.send_multipart(frames)

    def on_ready(self) -> None:
        """The peer's answers, relayed: its `tokens` and `done` under the client's own id."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ev = E.decode_event(frames)
            except (ValueError, P.ProtocolError) as e:  # a peer's garbage ends nothing here
                self.malformed += 1
                log.warning("handoff: a malformed event from the peer %s skipped: %r", self.peer, e)
                continue
            pid = ev.get("id")
            if not isinstance(pid, str) or pid not in self.routes:
                continue
            try:
                ev = peer_event(ev, self.n_vocab)
            except ValueError as e:  # its session ends here, with what its client was sent, and the peer drops it
                self.malformed += 1
                r = self.routes.pop(pid)
                self.sock.send_multipart(P.encode_request(P.Cancel(pid)))
                why = f"the drain's peer {self.peer} sent a malformed {ev.get('event')!r} event: {e}"
                log.warning("handoff: %s %s", r.key[1], why)
                self.end_here(r.key, R.DRAINED, why, r.relayed)
                continue
            if ev is not None:
                self._relay(pid, ev)

    def _relay(self, pid: str, ev: dict) -> None:
        """One checked peer event for a session it carries on: relayed under the client's id."""
        r = self.routes[pid]
        kind, (ident, id) = ev["event"], r.key
        if kind == "admitted":
            self.moved += 1  # its client was admitted here: no second one
        elif kind == "tokens":
            r.relayed += ev["tokens"]
            self.send(ident, _as(ev, id), False)
        elif kind == "done":
            del self.routes[pid]
            if ev["reason"] == R.CANCELLED and r.cut:
                ev["reason"] = R.DRAINED
            self.send(ident, _as(ev, id), True)
            self.ended(r.key)
        elif kind in ("rejected", "error"):
            del self.routes[pid]
            self.refused += 1
            why = f"the drain's peer {self.peer} refused it: {ev.get('reason') or ev.get('code')}: {ev['detail']}"
            log.warning("handoff: %s %s", id, why)
            self.end_here(r.key, R.DRAINED, why, r.relayed)

    def cancel(self, key: tuple) -> bool:
        """A client cancels a session relayed from the peer: the peer ends it (its `done` comes back)."""
        for pid, r in self.routes.items():
            if r.key == key:
                self.sock.send_multipart(P.encode_request(P.Cancel(pid)))
                return True
        return False

    def relays(self, key: tuple) -> bool:
        """The session is leaving for the peer, or relayed from it: its `done` here is not its client's."""
        return key in self.leaving or any(r.key == key for r in self.routes.values())

    def cut(self) -> None:
        """The drain's time is up: the peer stops what it still runs for us (its `done` CANCELLED comes back as
        DRAINED, if it comes before this node exits)."""
        for pid, r in self.routes.items():
            r.cut = True
            self.sock.send_multipart(P.encode_request(P.Cancel(pid)))

    def finish(self, wait_s: float) -> None:
        """The drain is over: the peer cancels what it still runs for this node, answering within `wait_s`;
        what it did not end ends here, DRAINED, with every token its client was sent."""
        if self.routes:
            self.cut()
            deadline = time.monotonic() + wait_s
            while self.routes and time.monotonic() < deadline:
                if self.sock.poll(50):
                    self.on_ready()
        for r in list(self.routes.values()):
            self.end_here(r.key, R.DRAINED, f"the drain's peer {self.peer} did not end it in time", r.relayed)
        self.routes.clear()

    def close(self) -> None:
        self.sock.close(linger=0)


def peer_event(ev: dict, n_vocab: int) -> dict | None:
    """A peer's event for a relayed session, checked as a client's request is and rebuilt from its known fields
    only (None for a kind the relay does not carry); ValueError names what is wrong. A peer's `done` without a
    reason, a token id outside this vocabulary (llama.cpp aborts decoding it) or a string in `tokens` once
    ended the drain, or left every client of it without its `done`."""
    kind = ev.get("event")
    if kind == "admitted":
        return {"event": kind}
    if kind in ("rejected", "error"):
        why, detail = ev.get("reason", ev.get("code")), ev.get("detail")
        _want(isinstance(why, str) and isinstance(detail, str), f"{kind} needs a reason and a detail (strings)")
        return {"event": kind, "reason": why[:64], "detail": detail[:P.MAX_TEXT_BYTES]}
    if kind not in ("tokens", "done"):
        return None
    toks, text = ev.get("tokens"), ev.get("text")
    _want(isinstance(toks, list) and len(toks) <= P.MAX_NEW_TOKENS
          and all(type(t) is int and 0 <= t < n_vocab for t in toks),
          f"its tokens must be a list of token ids in [0, {n_vocab})")
    _want(isinstance(text, str), "its text must be a string")
    out = {"event": kind, "tokens": toks, "text": text}
    if kind == "tokens":
        lps = ev.get("logprobs")
        if lps is not None:
            _want(isinstance(lps, list) and len(lps) == len(toks) and all(_logprob(x, n_vocab) for x in lps),
                  "its logprobs must be one {token, logprob, top} per token")
            out["logprobs"] = lps
        return out
    reason, usage = ev.get("reason"), ev.get("usage")
    _want(reason in R.DONE_REASONS, f"done needs a reason, one of {', '.join(sorted(R.DONE_REASONS))}")
    _want(isinstance(usage, dict) and len(usage) <= 32 and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        for k, v in usage.items()), "done needs usage, a map of counts and times")
    out |= {"reason": reason, "usage": usage}
    if ev.get("detail") is not None:
        _want(isinstance(ev["detail"], str), "its detail must be a string")
        out["detail"] = ev["detail"][:P.MAX_TEXT_BYTES]
    if ev.get("incomplete"):
        out["incomplete"] = True
    if isinstance(ev.get("stop"), str) and ev["stop"]:
        out["stop"] = ev["stop"][:P.MAX_TEXT_BYTES]
    return out


def _logprob(x, n_vocab: int) -> bool:
    ok = lambda d: (isinstance(d, dict) and type(d.get("token")) is int and 0 <= d["token"] < n_vocab  # noqa: E731
                    and isinstance(d.get("logprob"), (int, float)) and not isinstance(d["logprob"], bool))
    return ok(x) and isinstance(x.get("top"), list) and len(x["top"]) <= P.MAX_LOGPROBS and all(map(ok, x["top"]))


def _want(ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(why)


def _as(ev: dict, id: str) -> list[bytes]:
    """The peer's event as the client's own: the same fields under the client's id."""
    return E.event(ev["event"], **{k: v for k, v in ev.items() if k != "event"} | {"id": id})
