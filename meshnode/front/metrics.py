"""`/metrics` for Prometheus, served from the front's own loop: no thread, no lock.

The loop renders the text once per telemetry publication (`publish`) and hands
this server the sockets its poller found readable (`on_ready`), so a scrape
costs the loop a few microseconds, is metered with every other client request
(meshnode/cpushare.py), and never touches the scheduler. A second Python
thread would compete with the loop for the GIL on every scrape. Connections
are bounded in number and in time, so idle or slow clients cannot pile up.
"""
from __future__ import annotations

import socket
import time

from meshnode.core.types import ConfigError

MAX_CONNECTIONS = 16  # beyond, the oldest is closed for the new one
TIMEOUT_S = 2.0  # a connection that has not sent its request by then is closed
MAX_REQUEST_BYTES = 8192


class MetricsServer:
    def __init__(self, listen: str):
        host, _, port = listen.rpartition(":")
        try:
            self.sock = socket.create_server((host or "127.0.0.1", int(port)), backlog=MAX_CONNECTIONS)
        except OSError as e:  # a port in use is the most ordinary operator mistake: say which setting
            raise ConfigError(f"metrics_listen: cannot listen on {listen}: {e.strerror or e}") from None
        self.sock.setblocking(False)
        self._conns: dict[int, tuple[socket.socket, bytearray, float]] = {}
        self._body = b""

    def fds(self) -> list[int]:
        """What the loop's poller watches for this server."""
        return [self.sock.fileno(), *self._conns]

    def publish(self, body: bytes) -> None:
        """The text every scrape gets until the next publication (front/prom.py renders it)."""
        self._body = body

    def on_ready(self, fd: int) -> None:
        if fd == self.sock.fileno():
            return self._accept()
        conn, buf, _ = self._conns[fd]
        try:
            data = conn.recv(MAX_REQUEST_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        buf += data
        if not data or len(buf) > MAX_REQUEST_BYTES:
            return self._close(fd)
        if b"\r\n\r\n" in buf or b"\n\n" in buf:
            path = bytes(buf).split(b" ", 2)[1] if buf.count(b" ") >= 2 else b""
            self._answer(conn, path.split(b"?")[0])
            self._close(fd)

    def expire(self, now: float) -> None:
        for fd, (_, _, deadline) in list(self._conns.items()):
            if now > deadline:
                self._close(fd)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return
            if len(self._conns) >= MAX_CONNECTIONS:  # the oldest gives way: 16 idle ones locked every scraper out
                self._close(min(self._conns, key=lambda fd: self._conns[fd][2]))
            conn.setblocking(False)
            self._conns[conn.fileno()] = (conn, bytearray(), time.monotonic() + TIMEOUT_S)

    def _answer(self, conn: socket.socket, path: bytes) -> None:
        if path == b"/metrics":
            status, body, kind = b"200 OK", self._body, b"text/plain; version=0.0.4; charset=utf-8"
        else:
            status, body, kind = b"404 Not Found", b"only /metrics lives here\n", b"text/plain"
        head = b"HTTP/1.0 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (
            status, kind, len(body))
        try:  # a few KiB: the socket's send buffer takes it whole, or the client is gone
            conn.send(head + body)
        except OSError:
            pass

    def _close(self, fd: int) -> None:
        conn, _, _ = self._conns.pop(fd)
        conn.close()

    def close(self) -> None:
        for fd in list(self._conns):
            self._close(fd)
        self.sock.close()
