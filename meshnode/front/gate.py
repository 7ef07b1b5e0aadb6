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
completes its handshake is dropped by libzmq (ipc/transport.py, HANDSHAKE_S). RESERVE_FDS
stays free for the node itself and for a burst of accepts between a
connection's arrival and its shutdown.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from meshnode.ops.config import EVICT_AFTER_S

log = logging.getLogger("meshnode.front")

# libzmq 4.3.5's ipc listener asserts on EMFILE (ipc_listener.cpp:297; its tcp listener drops the connection
# instead): below this limit a flood on ipc:// faster than the gate closes connections can abort the front (1,100
# idle connections did at 1,024); past it a flood must outrun the gate by thousands of connections, from this host
SAFE_IPC_FDS = 8192
RESERVE_FDS = 256  # the node's own: engine restarts, metrics, logs, libzmq internals, a burst of accepts
# at the cap, a tcp connection that has not sent one byte for this long (no ZeroMQ greeting: every ZeroMQ peer
# sends one at once) gives way first: 1,100 such sockets held every new client out while they stayed
SILENT_S = 2.0
_TCP_INFO_BYTES_RECEIVED = 128  # struct tcp_info's tcpi_bytes_received (u64, Linux >= 4.1)
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


def client_room(max_clients: int, others: int) -> tuple[int, int]:
    """The descriptor limit (raised to the hard one) and the client connections it leaves room for beside
    `others` (subscribers, /metrics connections)."""
    limit, for_connections = descriptors()
    room = min(max_clients, for_connections - others)
    if room < 1:
        raise RuntimeError(f"the descriptor limit ({limit}) leaves no room for clients; raise it "
                           f"(LimitNOFILE= in the unit, ulimit -n) to at least {RESERVE_FDS + 100}")
    if room < max_clients:
        log.warning("the descriptor limit (%d) allows %d client connections, not max_clients=%d", limit, room,
                    max_clients)
    return limit, room


def open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


@dataclass
class Conn:
    since: float  # accepted, then the last request heard or answer sent
    ident: bytes | None = None  # the ROUTER identity its last request came with
    host: str | None = None  # the peer's address on tcp://


class Gate:
    """One listening socket's connections: counted, capped, and the idle ones given up first.

    At the cap, a new connection takes the place of the longest-idle one that has no session and no
    answer waiting (`busy()` names the identities that do) and has been quiet both ways for
    `evict_after_s`: a connection just sent a stream may still hold its end, unread, in ZeroMQ's queue
    on our side, which closing it would lose (its `done` with it);
    when there is none, the new one is closed instead, and its client's ZeroMQ socket keeps its
    requests and connects again until there is room. The silence matters: a request already on its
    way on a connection being closed is lost, so only a connection quiet for a while is taken. With
    `idle_s`, such a connection is also closed once it has been silent that long. A ZeroMQ client
    reconnects by itself, so closing an idle one costs it a handshake. A gate without `busy` (the
    telemetry PUB, whose subscribers never speak) only refuses. `per_host` caps the connections of one
    remote tcp:// address (loopback is the node's own machine, and ipc:// has no address)."""

    def __init__(self, sock: zmq.Socket, endpoint: str, cap: int, *, busy=None, idle_s: float = 0.0,
                 per_host: int = 0, evict_after_s: float = EVICT_AFTER_S, clock=time.monotonic):
        self.sock, self.endpoint, self.cap = sock, endpoint, cap
        self.busy, self.idle_s, self.per_host, self.clock = busy, idle_s, per_host, clock
        self.evict_after_s = evict_after_s
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.conns: dict[int, Conn] = {}  # by descriptor
        self._unheard: dict[int, float] = {}  # tcp connections nothing was heard on yet, oldest first
        self.refused_total = self.evicted_total = 0
        self._local = _local_address(endpoint)
        self._closing: set[int] = set()  # shut down by us: their DISCONNECTED is no news
        self._fd_of: dict[bytes, int] = {}  # identity -> the connection its last request came on
        # a descriptor's identity when its DISCONNECTED came: a new connection on the same number may have sent
        # its request (heard) before the monitor told of the old one's end, and must not come back unnamed (it
        # would be closed as idle under its live session)
        self._gone: dict[int, bytes] = {}

    @property
    def connected(self) -> int:
        return len(self.conns)

    def on_events(self) -> None:
        """Follow what the monitor saw: take each accepted connection in, or make room, or close it."""
        while self.monitor.poll(0):
            ev = recv_monitor_message(self.monitor)
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._accept(fd)
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                if fd in self._closing:
                    self._closing.discard(fd)
                else:
                    self._forget(fd)

    def _accept(self, fd: int) -> None:
        if fd in self.conns:  # heard from before this event came: taken in already
            return
        host = _peer_host(fd) if self.per_host and self.endpoint.startswith("tcp://") else None
        crowded = host is not None and sum(c.host == host for c in self.conns.values()) >= self.per_host
        if not crowded and len(self.conns) >= self.cap:
            victim = self._idlest()
            if victim is not None and self._close(victim):
                self.evicted_total += 1
        if crowded or len(self.conns) >= self.cap:
            if self._close(fd, known=False):
                self.refused_total += 1
            return
        self.conns[fd] = Conn(self.clock(), self._gone.pop(fd, None), host=host)
        if self.conns[fd].ident is not None:
            self._fd_of.setdefault(self.conns[fd].ident, fd)
        if self.endpoint.startswith("tcp://"):
            self._unheard[fd] = self.conns[fd].since

    def heard(self, fd: int | None, ident: bytes) -> None:
        """A request came on `fd` (its SRCFD) from `ident`: the connection is in use."""
        if fd is None or fd in self._closing:
            return
        self._unheard.pop(fd, None)
        conn = self.conns.pop(fd, None)  # re-inserted last: `conns` stays in the order of `since`
        if conn is None:  # its request overtook the monitor's ACCEPTED (two pipes, no order between them)
            conn = Conn(self.clock(), ident)
        else:
            conn.since, conn.ident = self.clock(), ident
        self.conns[fd] = conn
        self._fd_of[ident] = fd

    def sent(self, ident: bytes) -> None:
        """An answer went to `ident`: its connection is in use until the client could have read it."""
        fd = self._fd_of.get(ident, -1)
        conn = self.conns.get(fd)
        if conn is not None and conn.ident == ident:
            conn.since = self.clock()
            self.conns[fd] = self.conns.pop(fd)

    def _quiet(self, limit: float, busy: set):
        """The connections quiet since before `limit` with nothing owed, longest quiet first: `conns` is in
        the order of `since`, so the walk stops at the first one heard from since."""
        for fd, c in self.conns.items():
            if c.since > limit:
                return
            if c.ident not in busy:
                yield fd

    def expire(self) -> None:
        """Close the connections idle past `idle_s` (called once a second)."""
        if not self.idle_s:
            return
        for fd in list(self._quiet(self.clock() - self.idle_s, self._busy())):
            if self._close(fd):
                self.evicted_total += 1

    def _idlest(self) -> int | None:
        """The connection that gives way at the cap: the oldest tcp one whose peer has not sent a byte in
        SILENT_S (the kernel's count, so a client whose request waits unread is never taken for silent), else
        the idlest quiet for `evict_after_s` with nothing owed. The unheard are kept oldest first and each
        is looked at once, so a flood of silent connections at the cap costs a constant per accept."""
        if self.busy is None:
            return None
        now = self.clock()
        while self._unheard:
            fd, since = next(iter(self._unheard.items()))
            if since > now - SILENT_S:
                break
            del self._unheard[fd]
            if _bytes_received(fd) == 0:
                return fd
        return next(self._quiet(now - self.evict_after_s, self._busy()), None)

    def _busy(self) -> set:
        return self.busy() if self.busy is not None else set()

    def _close(self, fd: int, known: bool = True) -> bool:
        if not _shut_down(fd, self._local):
            return False
        self._closing.add(fd)
        if known:
            self._forget(fd)
        return True

    def _forget(self, fd: int) -> None:
        self._unheard.pop(fd, None)
        conn = self.conns.pop(fd, None)
        if conn is not None and conn.ident is not None:
            self._gone[fd] = conn.ident
        if conn is not None and self._fd_of.get(conn.ident) == fd:
            del self._fd_of[conn.ident]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)


def _peer_host(fd: int) -> str | None:
    """The remote address of a tcp connection, None for loopback (the node's own machine)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        host = s.getpeername()[0]
        return None if ipaddress.ip_address(host).is_loopback else host
    except (OSError, ValueError, IndexError):
        return None
    finally:
        s.detach()


def _bytes_received(fd: int) -> int:
    """What the peer of tcp connection `fd` has sent, by the kernel's count (-1 when it cannot say)."""
    import struct

    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return -1
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        return struct.unpack_from("<Q", info, _TCP_INFO_BYTES_RECEIVED)[0] if len(info) >= 136 else -1
    except OSError:
        return -1
    finally:
        s.detach()


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
