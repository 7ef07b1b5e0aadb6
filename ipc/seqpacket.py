"""The engine link's transport: one SOCK_SEQPACKET Unix socket in the private run dir.

Not ZeroMQ, on purpose. A zmq send wakes the sender's I/O thread, which wakes
the receiver's I/O thread, which wakes the receiver: with llama.cpp's threads
busy, that chain cost more than the whole rest of a tick's hand-over
(docs/architecture.md has the figures; `python -m benchmarks ipc` measures the bare
round trip). A SEQPACKET socket keeps message boundaries, and a send wakes the
receiving thread directly.

The front listens at a path in its 0700 run dir, one path per engine
incarnation, and accepts only the process it spawned (SO_PEERCRED). Both ends
exchange whole msgpack messages (ipc/link.py); a closed link reads as None.
"""
from __future__ import annotations

import socket
import struct

MAX_MESSAGE = 192 * 1024  # under the kernel's default socket buffer; link messages are a few KiB
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class LinkSocket:
    """One end of the engine link. Has fileno(), so a zmq.Poller can watch it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray(MAX_MESSAGE)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, data: bytes) -> None:
        """Send one message; the front's end is non-blocking and raises BlockingIOError when the
        engine has stopped reading (two ticks in flight never fill the buffer)."""
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"engine link message of {len(data)} bytes exceeds {MAX_MESSAGE}")
        self.sock.send(data)

    def recv(self) -> memoryview | None:
        """One whole message (valid until the next recv), or None when the peer closed the link
        (a killed peer with messages unread reads as a reset: the same thing here)."""
        try:
            n, _, flags, _ = self.sock.recvmsg_into([self._buf])
        except ConnectionResetError:
            return None
        if flags & socket.MSG_TRUNC:
            raise ValueError(f"engine link message over {MAX_MESSAGE} bytes")
        return memoryview(self._buf)[:n] if n else None

    def close(self) -> None:
        self.sock.close()


def listen(path: str) -> socket.socket:
    """The front's listening socket for one engine incarnation (non-blocking)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.bind(path)
        s.listen(1)
    except OSError:
        s.close()
        raise
    s.setblocking(False)
    return s


def accept(listener: socket.socket, pid: int) -> LinkSocket | None:
    """The engine's connection, or None; a connection from any process but `pid` is closed."""
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return None
    peer = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
    if peer != pid:
        conn.close()
        return None
    conn.setblocking(False)
    return LinkSocket(conn)


def connect(path: str) -> LinkSocket:
    """The engine's end (blocking)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(path)
    except OSError:
        s.close()
        raise
    return LinkSocket(s)
