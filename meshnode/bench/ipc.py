"""Round-trip latency of the engine link's transport vs a raw Unix socketpair.

A diagnostic for the per-tick front + IPC cost: one small message each way
between two processes, 2 ms apart (like ticks, so the peer is asleep when the
message arrives), over a ZeroMQ PAIR on ipc:// and over socket.socketpair().
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time

import zmq

N = 2000


def _zmq_echo(ep: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    s.connect(ep)
    while (m := s.recv()) != b"stop":
        s.send(m)
    s.close(0)
    ctx.term()


def _sock_echo(s: socket.socket) -> None:
    while (m := s.recv(64)) != b"stop":
        s.send(m)


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
    ep = f"ipc://{tempfile.mkdtemp()}/pp.sock"
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
    x, y = socket.socketpair()
    p = mp.get_context("fork").Process(target=_sock_echo, args=(y,))
    p.start()
    st = _time(x.send, lambda: x.recv(64))
    x.send(b"stop")
    p.join()
    for name, t in (("zmq PAIR over ipc://", zt), ("socketpair", st)):
        print(f"{name:22} round trip median {t[N // 2] * 1e6:5.0f} us  p90 {t[int(N * 0.9)] * 1e6:5.0f} us")
    print(f"(cpus {os.cpu_count()}; {N} round trips each, 2 ms apart)")
    return 0
