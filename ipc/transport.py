"""Socket factories: every ZeroMQ option of the node in one place (the engine link is not
ZeroMQ: ipc/seqpacket.py says why).

Defaults are safe: endpoints live in a 0700 run dir (ipc://) or on 127.0.0.1.
Every bound endpoint follows one rule (`check_private`): one that others can
reach (a non-loopback TCP address, or an abstract ipc://@name socket, which
has no filesystem permissions) needs CURVE unless the operator says
--insecure; every socket has LINGER 0 (never hang at exit), finite HWMs and,
on the client side, MAXMSGSIZE so an oversize frame disconnects its sender
instead of being buffered. ROUTER_MANDATORY makes an unroutable or stalled
client an error we count instead of a silent drop.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import socket as _socket
from dataclasses import dataclass
from pathlib import Path

import zmq

from ipc.protocol import MAX_MESSAGE_BYTES, TELEMETRY_TOPIC
from ipc.shm import alive

CLIENT_HWM = 1000  # events queued to one client before it counts as stalled (meshnode/outbox.py)
REQUEST_HWM = 64  # requests of one client read ahead of the front: at most 64 x 2 MiB held for it
HANDSHAKE_S = 10.0  # a connection to a listener that has not completed the ZeroMQ handshake by then is dropped


class EndpointError(RuntimeError):
    """An endpoint that must not or cannot be bound; the message says why."""


def run_dir() -> Path:
    """The private directory for ipc sockets and locks (systemd's RuntimeDirectory when set)."""
    base = os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("MESHNODE_RUN_DIR")
    if not base:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "meshnode") if xdg else f"/tmp/meshnode-{os.getuid()}"
    p = Path(base.split(":")[0])
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(p, 0o700)
    return p


def default_listen() -> str:
    return f"ipc://{run_dir()}/node.sock"


def default_telemetry() -> str:
    return f"ipc://{run_dir()}/telemetry.sock"


def clean_stale_links(directory: str) -> list[str]:
    """Remove engine-link sockets (engine-<front pid>-<n>.sock) whose front no longer exists."""
    removed = []
    for name in os.listdir(directory):
        m = re.fullmatch(r"engine-(\d+)-\d+\.sock", name)
        if m and int(m.group(1)) != os.getpid() and not alive(int(m.group(1))):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an ipc:// endpoint (None for tcp://, and for abstract ipc://@name)."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    return endpoint[len("ipc://"):]


def exposure(endpoint: str) -> str | None:
    """Why others than this host's node user could connect to `endpoint`, or None if they cannot."""
    if endpoint.startswith("ipc://@"):
        return "an abstract ipc socket has no filesystem permissions: any local user can connect"
    if endpoint.startswith(("ipc://", "inproc://")):
        return None
    head = endpoint[len("tcp://"):].rsplit(":", 1)[0] if endpoint.startswith("tcp://") else endpoint
    return next(filter(None, map(_host_exposure, head.split(","))), None)  # HOST[,HOST...]: any that is open


def _host_exposure(host: str) -> str | None:
    host = host.strip().strip("[]")
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # an interface name or '*'
    return "it accepts connections from other hosts"


def check_private(endpoint: str, what: str, curve: bool, insecure: bool) -> None:
    """The one rule for every endpoint the node binds: exposed needs CURVE, or --insecure."""
    why = exposure(endpoint)
    if why and not curve and not insecure:
        fix = "pass --curve-secret-key and --curve-allow-dir, or " if what != "metrics" else ""
        raise EndpointError(f"refusing to bind {what} endpoint {endpoint} without CURVE: {why}; {fix}pass "
                            f"--insecure to accept plaintext from anyone")


@dataclass
class Curve:
    """Server-side CURVE: our secret key, and the directory of allowed client public keys."""

    secret_key_file: str
    allow_dir: str


class EndpointLock:
    """An flock beside an ipc socket: a second node refuses instead of stealing the path."""

    def __init__(self, endpoint: str):
        self.path = None
        self.fd = None
        path = ipc_path(endpoint)
        if path is None:
            return
        self.path = path
        self.fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise EndpointError(f"{endpoint} is in use by another meshnode (lock {path}.lock held)") from None
        if os.path.exists(path):  # a crashed node's socket file: ours now that we hold the lock
            os.unlink(path)

    def release(self) -> None:
        if self.fd is None:
            return
        for p in (self.path, self.path + ".lock"):
            try:
                os.unlink(p)
            except OSError:
                pass
        os.close(self.fd)
        self.fd = None


def _base(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _listener(sock: zmq.Socket, handshake_s: float) -> zmq.Socket:
    """A socket that binds: a connection silent past `handshake_s` is dropped. Set before the bind: libzmq's
    listener copies the socket's options when it is bound, and one set later never reaches its connections
    (a node whose HANDSHAKE_IVL came after the bind held 1,100 greeting-less connections for good)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(handshake_s * 1000))
    return _base(sock)


def client_router(ctx: zmq.Context, endpoint: str, curve: Curve | None = None, insecure: bool = False,
                  auth_holder: list | None = None, handshake_s: float = HANDSHAKE_S) -> zmq.Socket:
    check_private(endpoint, "client", curve is not None, insecure)
    s = _listener(ctx.socket(zmq.ROUTER), handshake_s)
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    s.setsockopt(zmq.SNDHWM, CLIENT_HWM)
    s.setsockopt(zmq.RCVHWM, REQUEST_HWM)
    # up to 2x the protocol limit arrives and is answered TOO_LARGE (and counted); beyond, zmq drops the peer
    s.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)
    if curve is not None:
        _enable_curve(ctx, s, curve, auth_holder)
    _bind(s, endpoint)
    return s


def _enable_curve(ctx: zmq.Context, s: zmq.Socket, curve: Curve, auth_holder: list | None) -> None:
    """CURVE server on `s`; one authenticator per context serves every socket of it."""
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    public, secret = zmq.auth.load_certificate(curve.secret_key_file)
    if secret is None:
        raise EndpointError(f"{curve.secret_key_file} holds no secret key")
    if auth_holder is not None and not auth_holder:
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=curve.allow_dir)
        auth_holder.append(auth)
    s.curve_secretkey, s.curve_publickey, s.curve_server = secret, public, True


def telemetry_pub(ctx: zmq.Context, endpoint: str, curve: Curve | None = None, insecure: bool = False,
                  auth_holder: list | None = None, handshake_s: float = HANDSHAKE_S,
                  what: str = "telemetry") -> zmq.Socket:
    """The snapshot says model, recipe and load (KV events, prompts' token ids): the client socket's rule."""
    check_private(endpoint, what, curve is not None, insecure)
    s = _listener(ctx.socket(zmq.PUB), handshake_s)
    s.setsockopt(zmq.SNDHWM, 100)
    if curve is not None:
        _enable_curve(ctx, s, curve, auth_holder)
    _bind(s, endpoint)
    return s


def _client(ctx: zmq.Context, kind: int, server_public_key: bytes | None,
            client_cert: tuple[bytes, bytes] | None) -> zmq.Socket:
    """A connecting socket, CURVE client of the node when both keys are given."""
    s = _base(ctx.socket(kind))
    if server_public_key is not None and client_cert is not None:
        s.curve_serverkey = server_public_key
        s.curve_publickey, s.curve_secretkey = client_cert
    return s


def client_dealer(ctx: zmq.Context, endpoint: str, server_public_key: bytes | None = None,
                  client_cert: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    s = _client(ctx, zmq.DEALER, server_public_key, client_cert)
    s.connect(endpoint)
    return s


def telemetry_sub(ctx: zmq.Context, endpoint: str, server_public_key: bytes | None = None,
                  client_cert: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    s = _client(ctx, zmq.SUB, server_public_key, client_cert)
    s.setsockopt(zmq.SUBSCRIBE, TELEMETRY_TOPIC)
    s.setsockopt(zmq.RCVHWM, 10)
    s.connect(endpoint)
    return s


def client_curve(server_key_file: str | None, client_cert_file: str | None) -> dict:
    """The Client / telemetry_sub keyword arguments for a CURVE node, from zmq.auth certificate files."""
    if not server_key_file:
        return {}
    import zmq.auth

    server_public, _ = zmq.auth.load_certificate(server_key_file)
    if not client_cert_file:
        raise EndpointError("a CURVE node needs this client's own certificate too (--curve-client-cert)")
    public, secret = zmq.auth.load_certificate(client_cert_file)
    if secret is None:
        raise EndpointError(f"{client_cert_file} holds no secret key")
    return {"server_public_key": server_public, "client_cert": (public, secret)}


def _bind(s: zmq.Socket, endpoint: str) -> None:
    try:
        s.bind(endpoint)
    except zmq.ZMQError as e:
        s.close(0)
        raise EndpointError(f"cannot bind {endpoint}: {e}") from None


def free_tcp_port() -> int:
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reachable(endpoint: str, timeout_s: float = 0.5) -> str:
    """"" when a TCP connection to HOST:PORT opens (and is closed at once), else why not. ggml's RPC
    server takes the next connection when its current client leaves: an open is all this checks."""
    from meshnode.core.endpoints import host_port

    try:
        host, port = host_port(endpoint)
        with _socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except (OSError, ValueError) as e:
        return f"rpc worker {endpoint} unreachable: {e.strerror if isinstance(e, OSError) and e.strerror else e}"


# ggml's RPC protocol (ggml-rpc.cpp in the vendored llama.cpp, protocol 7.0.0): every connection opens with
# | RPC_CMD_HELLO (1 byte) | request size (u64) | conn_caps (24 bytes) |, answered | size (u64) | major, minor,
# patch, padding, conn_caps (24 bytes) |
RPC_CMD_HELLO, RPC_CONN_CAPS, RPC_PROTO_MAJOR = 14, 24, 7


def rpc_hello(endpoint: str, timeout_s: float) -> str:
    """"" when the ggml RPC server at HOST:PORT answers a hello within `timeout_s`, else why not, naming it.
    An open port is not enough: a worker stopped, or busy with another node (it serves one at a time), accepts
    the connection and never answers, and ggml would wait on it for ever. Zero capabilities ask for no upgrade
    of the transport; the connection is closed right after, so the worker takes its next client."""
    import struct

    from meshnode.core.endpoints import host_port

    try:
        host, port = host_port(endpoint)
        with _socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS) + bytes(RPC_CONN_CAPS))
            answer = b""
            while len(answer) < 12:
                got = s.recv(12 - len(answer))
                if not got:
                    return (f"rpc worker {endpoint} closed the connection without answering its hello (not a ggml "
                            "RPC server?)")
                answer += got
    except _socket.timeout:
        return (f"rpc worker {endpoint} does not answer (no hello within {timeout_s:g} s: stopped, or serving "
                "another node)")
    except (OSError, ValueError) as e:
        return f"rpc worker {endpoint} unreachable: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
    size, major = struct.unpack("<Q", answer[:8])[0], answer[8]
    if size != 4 + RPC_CONN_CAPS or major != RPC_PROTO_MAJOR:
        return (f"rpc worker {endpoint} speaks another RPC protocol (version {major}, this node's ggml "
                f"{RPC_PROTO_MAJOR}): run the same llama-cpp-python on both")
    return ""


def api_keys(path: str | None) -> set[bytes]:
    """The keys of `path`, one a line, as UTF-8 bytes (a BOM and the whitespace around a key dropped; a line
    whose first non-blank character is `#` is a comment). ValueError when the file names no key: a key file
    that holds none must never mean "no authentication"."""
    if not path:
        return set()
    with open(path, encoding="utf-8-sig") as f:
        lines = [line.strip() for line in f]
    keys = {line.encode() for line in lines if line and not line.startswith("#")}
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key (one a line; lines starting with # are comments)")
    return keys
