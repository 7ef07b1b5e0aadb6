"""Sending to clients, and keeping a stalled client's final answers until it reads again.

The ROUTER refuses a send once a client's queue holds CLIENT_HWM messages (the
client stopped reading). Dropping then would break the protocol's promise of
exactly one `done` per session: the client would wait forever. So a stalled
client's streamed `tokens` are dropped (its `done` carries every token), and
everything final (`done`, `admitted`, `rejected`, `error`, `status`, `pong`) is
kept, in order, up to MAX_PENDING messages, and sent as soon as its queue has
room again. A client that has disconnected gets nothing: there is nobody to
deliver to.
"""
from __future__ import annotations

import errno
from collections import deque

import zmq

MAX_PENDING = 1024  # final answers kept for one stalled client
_MORE, _LAST = int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.NOBLOCK)
SENT, KEPT, STALLED, GONE, DROPPED = "sent", "kept", "stalled", "gone", "dropped"


class Outbox:
    def __init__(self, router: zmq.Socket, max_pending: int = MAX_PENDING):
        self.router = router
        self.max_pending = max_pending
        self.pending: dict[bytes, deque] = {}  # stalled clients' kept answers, oldest first
        self.dropped_total = 0  # messages that could not be delivered nor kept

    def send(self, ident: bytes, frames: list[bytes], final: bool = True) -> str:
        """SENT, KEPT (the client is stalled), STALLED (this send found it stalled: the caller ends
        its sessions), GONE (disconnected) or DROPPED (a stalled client's token stream or overflow)."""
        queue = self.pending.get(ident)
        if queue is not None:
            return self._keep(queue, frames, final)
        outcome = self._try(ident, frames)
        if outcome == STALLED:
            self.pending[ident] = queue = deque()
            self._keep(queue, frames, final)
        elif outcome == GONE:
            self.dropped_total += 1
        return outcome

    def flush(self) -> None:
        """Send what stalled clients can take now; forget clients that have gone."""
        for ident in list(self.pending):
            queue = self.pending[ident]
            while queue:
                outcome = self._try(ident, queue[0])
                if outcome == STALLED:
                    break
                if outcome == GONE:
                    self.dropped_total += len(queue)
                    queue.clear()
                    break
                queue.popleft()
            if not queue:
                del self.pending[ident]

    def _keep(self, queue: deque, frames: list[bytes], final: bool) -> str:
        if not final or len(queue) >= self.max_pending:
            self.dropped_total += 1
            return DROPPED
        queue.append(frames)
        return KEPT

    def _try(self, ident: bytes, frames: list[bytes]) -> str:
        send = self.router.send
        try:  # plain int flags: send_multipart's enum arithmetic costs more than the send
            send(ident, _MORE)
        except zmq.Again:
            return STALLED
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                return GONE
            raise
        send(frames[0], _MORE)  # a ROUTER takes the rest of a message whose first frame it took
        send(frames[1], _LAST)
        return SENT
