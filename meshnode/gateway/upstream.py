"""The gateway's one connection to the node: a DEALER over which every HTTP request is a session, read
on the event loop's own wake-ups, each event handed to its session's queue.

The DEALER is a plain ZeroMQ socket watched through its FD (ZeroMQ's edge-triggered notification: every
wake drains all that has come), not a zmq.asyncio one: that one built a future, a poller registration and
a dozen flag enums for every event, a third of the gateway's CPU a streamed token (cProfile, 8 streams).

A request whose HTTP client went away is cancelled at the node and its events are dropped until its
final one. When the connection drops (the node restarted, or closed it) or the node stops answering
pings, every open session gets one synthetic error event: the node answers a new connection under a new
identity, so what the old one was owed never comes, and no HTTP request may wait for it for ever.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

import zmq
from zmq.utils.monitor import parse_monitor_message

from ipc import protocol as P
from ipc import events as E
from ipc.transport import client_dealer

log = logging.getLogger("meshnode.gateway")
PING_EVERY_S, NODE_SILENT_S = 2.0, 10.0
NODE_GONE = "NODE_UNREACHABLE"  # the synthetic error code (docs/gateway.md)
FINAL = ("rejected", "done", "error", "counted")
# plain ints: an int & a zmq Flag member builds a new enum member each time, per event
EVENTS, POLLIN, POLLOUT, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)


class Upstream:
    def __init__(self, endpoint: str, **curve):
        self.ctx = zmq.Context()
        self.sock = client_dealer(self.ctx, endpoint, **curve)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sessions: dict[str, asyncio.Queue | None] = {}  # None: abandoned, dropped at its final event
        self._replies: deque[asyncio.Future | None] = deque()  # status / ping waiters, answered in order
        self._outgoing: deque[list[bytes]] = deque()  # requests for _ready to send, in order (at the HWM, later)
        self._heard = 0.0
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._heard = self._loop.time()
        self._loop.add_reader(self.sock.FD, self._ready)
        self._loop.add_reader(self.monitor.FD, self._connection)
        self._loop.call_soon(self._ready)  # what came before the readers were added raised no edge
        self._loop.call_soon(self._connection)
        self._tasks = [asyncio.create_task(self._watch())]

    def open(self, submit: P.Submit | P.Count) -> asyncio.Queue:
        """The session's event queue; ValueError (nothing registered, nothing sent) when the request cannot go
        to the node: it does not encode, or it is over the node's message limit."""
        try:
            frames = P.encode_request(submit)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"the request cannot be encoded for the node: {e}") from None
        if len(frames[1]) > P.MAX_MESSAGE_BYTES:
            raise OverflowError(f"the request is {len(frames[1])} bytes for the node, over its {P.MAX_MESSAGE_BYTES}")
        q = self.sessions[submit.id] = asyncio.Queue()
        self._send(frames)
        return q

    def finished(self, sid: str) -> None:
        """The handler has the final event: forget the session."""
        self.sessions.pop(sid, None)

    def abandon(self, sid: str) -> None:
        """The HTTP client went away before the end: cancel at the node, drop what still comes."""
        if sid in self.sessions:
            self.sessions[sid] = None
            self._send(P.encode_request(P.Cancel(sid)))

    async def ask(self, req, timeout_s: float = 5.0) -> dict:
        """A status, metrics or ping answer."""
        fut = asyncio.get_running_loop().create_future()
        self._replies.append(fut)
        self._send(P.encode_request(req))
        return await asyncio.wait_for(fut, timeout_s)

    def _send(self, frames: list[bytes]) -> None:
        """Sent by _ready on the loop's next turn, in order: any call on the socket may take the FD's edge
        for an event that came meanwhile, so every call is made where the events are read right after."""
        self._outgoing.append(frames)
        self._loop.call_soon(self._ready)

    def _ready(self) -> None:
        """Everything the socket allows now: waiting requests out, then every event in."""
        while not self.sock.closed:  # a turn scheduled before close() may come after it
            events = self.sock.getsockopt(EVENTS)
            if self._outgoing and events & POLLOUT:
                self.sock.send_multipart(self._outgoing.popleft(), NOBLOCK)
            elif events & POLLIN:
                self._on_event(self.sock.recv_multipart(NOBLOCK))
            else:
                return

    def _on_event(self, frames: list[bytes]) -> None:
        try:
            ev = E.decode_event(frames)
        except P.ProtocolError as e:  # the node is trusted; a frame it did not mean is logged, not fatal
            log.error("a malformed event from the node, dropped: %s", e)
            return
        self._heard = self._loop.time()
        sid = ev.get("id")
        if sid is not None and sid in self.sessions:
            q = self.sessions[sid]
            if q is not None:
                q.put_nowait(ev)
            elif ev["event"] in FINAL:
                del self.sessions[sid]
        elif sid is None and ev["event"] == "error":  # no request of ours is answered so: not a status reply
            log.error("an error from the node that names no request, dropped: %s", ev.get("detail"))
        elif sid is None and ev["event"] in ("status", "pong", "metrics") and self._replies:
            fut = self._replies.popleft()
            if fut is not None and not fut.done():
                fut.set_result(ev)

    async def _watch(self) -> None:
        """Ping the node while anyone waits on it; when it has been silent too long, end every session."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PING_EVERY_S)
            if not self.sessions:
                self._heard = loop.time()
                continue
            self._replies.append(None)  # the pong's place in line; nobody awaits it
            self._send(P.encode_request(P.Ping()))
            if loop.time() - self._heard > NODE_SILENT_S:
                self._end_all(f"the node has not answered for {NODE_SILENT_S:.0f} s")

    def _connection(self) -> None:
        """The monitor's events, all that have come (its FD is edge-triggered too)."""
        while self.monitor.getsockopt(EVENTS) & POLLIN:
            ev = parse_monitor_message(self.monitor.recv_multipart(NOBLOCK))
            if ev["event"] != zmq.EVENT_DISCONNECTED:
                continue
            while self._replies:  # asked on the old connection: their answers will not come
                fut = self._replies.popleft()
                if fut is not None and not fut.done():
                    fut.set_exception(ConnectionError("the connection to the node was lost"))
            if self.sessions:
                self._end_all("the connection to the node was lost (it restarted, or closed the connection)")

    def _end_all(self, why: str) -> None:
        log.error("%s: ending %d open requests", why, len(self.sessions))
        for sid, q in list(self.sessions.items()):
            if q is not None:
                q.put_nowait({"event": "error", "id": sid, "code": NODE_GONE, "detail": why})
            del self.sessions[sid]

    async def close(self) -> None:
        self._loop.remove_reader(self.sock.FD)
        self._loop.remove_reader(self.monitor.FD)
        for t in self._tasks:
            t.cancel()
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()
