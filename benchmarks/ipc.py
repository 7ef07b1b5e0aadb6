"""Round-trip latency of the engine link's transport vs a ZeroMQ PAIR on ipc://.

A diagnostic for the per-tick front + IPC cost, and the reason the engine link
is not ZeroMQ: one small message each way between two processes, 2 ms apart
(like ticks, so the peer is asleep when the message arrives), over a ZeroMQ
PAIR on ipc:// and over the engine link's own SOCK_SEQPACKET socket.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

import zmq

from ipc import seqpacket

N = 2000


def _zmq_echo(ep: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    s.connect(ep)
    while (m := s.recv()) != b"stop":
        s.send(m)
    s.close(0)
    ctx.term()


def _link_echo(path: str) -> None:
    s = seqpacket.connect(path)
    while (m := bytes(s.recv())) != b"stop":
        s.send(m)
    s.close()


def _time(send, recv) -> list[float]:
    out = []
    for _ in range(N):
        t0 = time.perf_counter()
        send(b"x")
        recv()
        out.append(time.perf_counter() - t0)
        time.sleep(0.002)
    return sorted(out)


def main(a) -> int:
    tmp = tempfile.mkdtemp()
    ep = f"ipc://{tmp}/pp.sock"
    ctx = zmq.Context()
    z = ctx.socket(zmq.PAIR)
    z.setsockopt(zmq.LINGER, 0)
    z.bind(ep)
    p = mp.get_context("spawn").Process(target=_zmq_echo, args=(ep,))
    p.start()
    z.send(b"x")
    z.recv()
    zt = _time(z.send, z.recv)
    z.send(b"stop")
    p.join()
    z.close(0)
    ctx.term()
    listener = seqpacket.listen(f"{tmp}/link.sock")
    p = mp.get_context("spawn").Process(target=_link_echo, args=(f"{tmp}/link.sock",))
    p.start()
    while (x := seqpacket.accept(listener, p.pid)) is None:
        time.sleep(0.01)
    x.sock.setblocking(True)
    st = _time(x.send, x.recv)
    x.send(b"stop")
    p.join()
    x.close()
    listener.close()
    os.unlink(f"{tmp}/link.sock")
    for name, t in (("zmq PAIR over ipc://", zt), ("engine link (SEQPACKET)", st)):
        print(f"{name:24} round trip median {t[N // 2] * 1e6:5.0f} us  p90 {t[int(N * 0.9)] * 1e6:5.0f} us")
    print(f"(cpus {os.cpu_count()}; {N} round trips each, 2 ms apart)")
    return 0
