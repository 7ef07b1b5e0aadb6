"""RPC workers as child processes, and a TCP proxy that delays every byte (tests and `bench rpc`).

The delay proxy stands in for a network where `tc netem` cannot run (this VM's kernel has no netem):
each chunk read from one side is written to the other `one_way_ms` after it arrived, in order, in both
directions, so a request-response costs one extra round trip of 2 x one_way_ms. The proxy's own cost
(a Python hop) is what a 0 ms proxy measures, and figures through it are read against that.
"""
from __future__ import annotations

import heapq
import socket
import subprocess
import sys
import threading
import time

from ipc.transport import free_tcp_port


class RpcWorker:
    """`meshnode rpc-worker` on 127.0.0.1, on a port of its own that a restart keeps."""

    def __init__(self, port: int | None = None, threads: int = 1, extra: tuple = ()):
        self.port, self.threads, self.extra = port or free_tcp_port(), threads, extra
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RpcWorker":
        self.proc = subprocess.Popen([sys.executable, "-m", "meshnode", "rpc-worker", "--listen", self.endpoint,
                                      "--threads", str(self.threads), *self.extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:  # its log: the ready line, or why it did not start
            if "rpc-worker ready" in line:
                return self
        raise RuntimeError(f"rpc-worker exited with {self.proc.wait()}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc:
            self.proc.stderr.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.kill()


class DelayProxy:
    """127.0.0.1:<port> -> `upstream`, every chunk held `one_way_ms` in each direction."""

    def __init__(self, upstream: str, one_way_ms: float):
        host, port = upstream.rsplit(":", 1)
        self.upstream, self.delay = (host, int(port)), one_way_ms / 1e3
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = socket.create_connection(self.upstream)
            for s in (a, b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst in ((a, b), (b, a)):
                _Pump(src, dst, self.delay)

    def close(self) -> None:
        self._stop = True
        self.listener.close()


class _Pump:
    """One direction: a reader stamps each chunk, a writer sends it when its time has come."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float):
        self.src, self.dst, self.delay = src, dst, delay
        self.due: list = []
        self.seq = 0
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.src.recv(1 << 20)
            except OSError:
                data = b""
            with self.cv:
                self.seq += 1
                heapq.heappush(self.due, (time.monotonic() + self.delay, self.seq, data))
                self.cv.notify()
            if not data:
                return

    def _write(self) -> None:
        while True:
            with self.cv:
                while not self.due:
                    self.cv.wait()
                at, _, data = self.due[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self.cv.wait(wait)
                    continue
                heapq.heappop(self.due)
            try:
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
            except OSError:
                return
