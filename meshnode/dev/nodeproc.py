"""Run a node as a child process (sweeps, benchmarks, tests): start, wait for ready, stop.

Each node gets its own run dir, so several can run side by side, and `stop()`
sends SIGTERM and waits, so the node drains and cleans up like in production.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

from meshnode.client import Client


class NodeProcess:
    def __init__(self, model: str | None, *args: str, internal: dict | None = None, log_path: str | None = None,
                 run_dir: str | None = None, env: dict | None = None, listen: str | None = None,
                 connect: str | None = None, client_kw: dict | None = None, nofile: int | None = None,
                 python: str | None = None):
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="meshnode-node-")
        listen = listen or f"ipc://{self.run_dir}/node.sock"
        self.listen = connect or listen  # where clients connect (a wildcard bind is not an address)
        self.telemetry = f"ipc://{self.run_dir}/telemetry.sock"
        # test and drill settings (a fake engine, faults) go through the dev entry, never `meshnode serve`
        entry = ["meshnode.dev.serve", json.dumps(internal)] if internal else ["meshnode", "serve"]
        # `python`: another interpreter, e.g. one whose llama.cpp was built differently (benchmarks)
        self.args = [python or sys.executable, "-m", *entry, *(["--model", model] if model else []),
                     "--listen", listen, "--telemetry", self.telemetry, *args]
        self.env = dict(os.environ, MESHNODE_RUN_DIR=self.run_dir, **(env or {}))
        self.log_path = log_path or os.path.join(self.run_dir, "node.log")
        self.proc: subprocess.Popen | None = None
        self.client_kw = client_kw or {}  # e.g. CURVE keys for the readiness ping
        self.nofile = nofile  # the node's descriptor limit, soft and hard (tests of exhaustion)

    def start(self, timeout_s: float = 120.0) -> "NodeProcess":
        self._log = open(self.log_path, "w")
        limit = None if self.nofile is None else (
            lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile)))
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=limit)
        deadline = time.monotonic() + timeout_s
        with Client(self.listen, timeout_s=1.0, **self.client_kw) as c:
            sent = 0
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"node exited with {self.proc.returncode}:\n{self.log()}")
                sent += 1
                if c.ping(0.5):
                    # the pings that timed out are answered too: read them before leaving, or the node counts
                    # answers to a closed client as undeliverable after a test has read its counters
                    for _ in range(sent - 1):
                        c.wait_for(lambda e: e["event"] == "pong", max(1.0, deadline - time.monotonic()))
                    return self
        self.stop()
        raise RuntimeError(f"node not ready within {timeout_s} s:\n{self.log()}")

    def client(self, timeout_s: float = 60.0) -> Client:
        return Client(self.listen, timeout_s=timeout_s, **self.client_kw)

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
