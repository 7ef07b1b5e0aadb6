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
    def __init__(self, zctx: zmq.Context, peer: str, send, end_here, ended):
        """`send(ident, frames, final)`: to a client (Clients.send); `end_here(key, reason, detail, relayed)`: the
        output stage ends a session the peer would not take or did not finish, as a drain without a peer would
        (Output.end_moved); `ended(key)`: the peer's `done` went to its client (Output.forget_moved)."""
        self.peer, self.send, self.end_here, self.ended = peer, send, end_here, ended
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
                self._relay(E.decode_event(frames))
            except (ValueError, KeyError, TypeError, P.ProtocolError) as e:  # a peer's garbage ends nothing here
                self.malformed += 1
                log.warning("handoff: a malformed event from the peer %s skipped: %r", self.peer, e)

    def _relay(self, ev: dict) -> None:
        """One peer event for a session it carries on: relayed under the client's id."""
        r = self.routes.get(ev.get("id"))
        if r is None:
            return
        kind, (ident, id) = ev["event"], r.key
        if kind == "admitted":
            self.moved += 1  # its client was admitted here: no second one
        elif kind == "tokens":
            r.relayed += ev["tokens"]
            self.send(ident, _as(ev, id), False)
        elif kind == "done":
            del self.routes[ev["id"]]
            if ev["reason"] == R.CANCELLED and r.cut:
                ev["reason"] = R.DRAINED
            self.send(ident, _as(ev, id), True)
            self.ended(r.key)
        elif kind in ("rejected", "error"):
            del self.routes[ev["id"]]
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


def _as(ev: dict, id: str) -> list[bytes]:
    """The peer's event as the client's own: the same fields under the client's id."""
    return E.event(ev["event"], **{k: v for k, v in ev.items() if k != "event"} | {"id": id})
