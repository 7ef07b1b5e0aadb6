"""`python -m benchmarks embed --model smollm2-q8_0 --llama-server PATH`: /v1/embeddings through the node's gateway
beside llama-server's (`--embedding --pooling mean`, the same model and threads): the cosine of each input's two
vectors (the goal: >= 0.9999) and what a request of all the inputs takes on each side (best of the rounds).

Inputs: the spec bench's eight chat questions and its code file (benchmarks/spec.py), each a string, as an
OpenAI client sends them; both sides tokenize them (each adds the BOS the model asks for). The node serves
them beside generation, pooled by its engine (engine/embeddings.py); llama-server pools in its graph, in a
context made for embeddings, one slot (see main: its batched answers are wrong on this build).
"""
from __future__ import annotations

import json
import os
import time

import httpx
import numpy as np

from benchmarks.spec import CHATS, CODE
from ipc.transport import free_tcp_port
from meshnode.bench import llama_build, model_path
from meshnode.bench.llama_server import LlamaServer
from meshnode.dev.nodeproc import NodeProcess

INPUTS = [*CHATS.values(), CODE]


def vectors(base: str, rounds: int) -> tuple[np.ndarray, float]:
    """Every input's vector in one request, and the fastest request of `rounds` (ms)."""
    best, out = float("inf"), None
    for _ in range(rounds):
        t0 = time.monotonic()
        r = httpx.post(f"{base}/v1/embeddings", json={"input": INPUTS, "model": "m"}, timeout=600)
        best = min(best, time.monotonic() - t0)
        r.raise_for_status()
        out = np.array([d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])])
    return out, best * 1e3


def up(base: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{base} did not come up")


def main(a) -> int:
    if not a.llama_server:
        raise SystemExit("bench embed: needs --llama-server PATH (the peer it compares with)")
    path, threads = model_path(a), a.threads or os.cpu_count()
    print(f"bench embed: {os.path.basename(path)}, {len(INPUTS)} inputs in one request, mean pooling, threads "
          f"{threads}, best of {a.rounds}; {llama_build()}", flush=True)
    port = free_tcp_port()
    with NodeProcess(path, "--threads", str(threads), "--http", f"127.0.0.1:{port}", "--log-level", "WARNING"):
        base = f"http://127.0.0.1:{port}"
        up(base)
        node, node_ms = vectors(base, a.rounds)
    # one slot: with 8, this build's llama-server answers a request of several inputs with vectors mixed across
    # them (cosine 0.62-0.96 to its own one-slot vectors, measured with /tmp scripts on SmolLM2 q8_0; one input
    # a request is right), and with 9 it aborts at start (GGML_ASSERT ggml_can_mul_mat)
    slots = 1
    with LlamaServer(a.llama_server, path, threads, slots=slots, ctx=4096 * slots,
                     extra=("--embedding", "--pooling", "mean"), probe="/health") as server:
        peer, peer_ms = vectors(f"http://127.0.0.1:{server.port}", a.rounds)
    cos = [float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))) for x, y in zip(node, peer)]
    verdict = (f"cosine node / llama-server per input: min {min(cos):.6f}, " + ", ".join(f"{c:.6f}" for c in cos)
               + f" (goal >= 0.9999: {'met' if min(cos) >= 0.9999 else 'NOT met'}); a request of all {len(INPUTS)}: "
               f"node {node_ms:.0f} ms, llama-server {peer_ms:.0f} ms ({node_ms / peer_ms:.2f}x)")
    print(verdict)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "cosine": cos, "node_ms": node_ms,
                       "llama_server_ms": peer_ms, "verdict": verdict}, f, indent=1)
    return 0
