"""How many connections a listening socket may hold, so clients can never exhaust the descriptors.

Every connection to a ZeroMQ listener costs the front a file descriptor, taken
by libzmq's I/O thread on accept, before the front sees anything. At the
process's descriptor limit libzmq aborts the whole front on an ipc:// accept
(src/ipc_listener.cpp tolerates ENFILE but asserts on EMFILE), and over tcp://
the node can no longer open what an engine restart needs. So each listener has
a cap: a socket monitor reports every accepted connection with its descriptor,
and one beyond the cap is shut down at once (libzmq then closes it), leaving
everyone already connected alone. Unbinding instead would drop them all
(zmq_unbind discards the endpoint's connections). A connection that never
completes its handshake is dropped by libzmq after HANDSHAKE_S. RESERVE_FDS
stays free for the node itself and for a burst of accepts between a
connection's arrival and its shutdown.
"""
from __future__ import annotations

import logging
import os
import resource
import socket

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("meshnode.front")

RESERVE_FDS = 256  # the node's own: engine restarts, metrics, logs, libzmq internals, a burst of accepts
HANDSHAKE_S = 10.0  # a connection silent this long after connecting is dropped
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


def descriptors() -> tuple[int, int]:
    """(the soft descriptor limit after raising it to the hard one, what connections may use)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft, max(0, soft - RESERVE_FDS)


def open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class Gate:
    """One listening socket's connections: counted, and closed at once beyond `cap`."""

    def __init__(self, sock: zmq.Socket, endpoint: str, cap: int):
        self.sock, self.endpoint, self.cap = sock, endpoint, cap
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.connected = 0
        self.refused_total = 0
        self._local = _local_address(endpoint)
        self._refused_fds: set[int] = set()

    def on_events(self) -> None:
        """Count what the monitor saw; shut down each connection accepted beyond the cap."""
        while self.monitor.poll(0):
            ev = recv_monitor_message(self.monitor)
            if ev["event"] == zmq.EVENT_ACCEPTED:
                if self.connected >= self.cap and _shut_down(int(ev["value"]), self._local):
                    self.refused_total += 1  # its DISCONNECTED follows, which is not counted then
                    self._refused_fds.add(int(ev["value"]))
                else:
                    self.connected += 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                fd = int(ev["value"])
                if fd in self._refused_fds:
                    self._refused_fds.discard(fd)
                else:
                    self.connected = max(0, self.connected - 1)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)


def _local_address(endpoint: str):
    """What getsockname() says for a connection accepted on `endpoint`."""
    if endpoint.startswith("ipc://"):
        return endpoint[len("ipc://"):]
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return None if host in ("*", "0.0.0.0", "[::]", "") else (host.strip("[]"), int(port))


def _shut_down(fd: int, local) -> bool:
    """Shut down the connection on `fd`, only if it still is one on this listener: libzmq may have
    closed it already and the number been reused for another of the node's own sockets."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        name = s.getsockname()
        if isinstance(name, tuple):
            name = name[:2]
        if local is not None and name != local or local is None and not isinstance(name, tuple):
            return False
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        s.detach()  # the descriptor stays libzmq's: it closes it when it sees the shutdown
