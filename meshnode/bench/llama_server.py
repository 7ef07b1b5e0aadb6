"""llama.cpp's own server as the peer in a benchmark: started, driven over HTTP, stopped.

Build it from the llama.cpp that llama-cpp-python vendors (README, "Benchmarks"), so both
sides run the same kernels; it gets the same model, threads and context as the node.
"""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time


class Stop(Exception):
    """Raised by an `on_token` callback to hang up (llama-server then cancels the request)."""


class LlamaServer:
    def __init__(self, binary: str, model: str, threads: int, slots: int, ctx: int, extra: tuple = (),
                 probe: str = "/completion"):
        """`probe`: what says it is ready: a short /completion (its weights paged in), or a GET of this path
        (an --embedding server, which generates nothing)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [binary, "-m", model, "-np", str(slots), "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
                    "--port", str(self.port), "--no-warmup", *extra]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                if probe == "/completion":
                    self.complete([3, 4, 5], 2)  # ready, and its weights paged in as the node's warm-up does
                    return
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", probe)
                if conn.getresponse().status == 200:
                    return
                raise RuntimeError("not ready")
            except (OSError, RuntimeError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError(f"llama-server did not start: {' '.join(self.cmd)}") from None
                time.sleep(0.5)

    def complete(self, tokens: list[int], n: int, on_token=None, final: dict | None = None,
                 **params) -> tuple[list[int], float | None]:
        """One streamed /completion with prompt caching, greedy and past EOS unless `params` (its request
        fields) say otherwise; (tokens, ms to the first one). `on_token(time)` runs as each token arrives
        and may raise Stop. `final` receives the server's last message: its counts (`tokens_predicted`; a
        stream holds back tokens that end inside a UTF-8 character and never sends the last of them) and
        `stop_type`."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        body = json.dumps({"prompt": tokens, "n_predict": n, "temperature": 0, "ignore_eos": True,
                           "return_tokens": True, "stream": True, "cache_prompt": True, **params})
        t0 = time.monotonic()
        out, ttft = [], None
        try:
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:200]!r}")
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                msg = json.loads(line[6:])
                now = time.monotonic()
                for tok in msg.get("tokens") or []:
                    ttft = ttft if ttft is not None else (now - t0) * 1e3
                    out.append(tok)
                    if on_token:
                        on_token(now)
                if msg.get("stop"):
                    if final is not None:
                        final.update(msg)
                    break
        except Stop:
            pass
        finally:
            conn.close()
        return out, ttft

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
