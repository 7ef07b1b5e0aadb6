"""`meshnode bench ...`: the benchmark harnesses, which print ratios measured side by side in one run.

Speed targets are checked here, not in timed unit tests: the machines are
shared and noisy, so only figures measured in the same run are compared.
"""
from __future__ import annotations

import argparse
import importlib

# the harnesses an operator runs against a node or a build (README, Benchmarks); the one-off experiments that
# produced the figures in evidence/ live in the top-level benchmarks/ (`python -m benchmarks NAME` from a checkout)
BENCHES = {
    "overhead": "the full node vs the engine in-process with the same scheduler",
    "peers": "16 jobs through the node at concurrency 8 vs Llama serving them one at a time",
    "burst": "in-flight ITL and burst TTFT for each prefill chunk size",
    "scale": "the node's own time per tick over a 5 ms fake engine, and plan()/apply(), at 1-64 sessions",
    "gateway": "the OpenAI HTTP gateway vs the ZeroMQ client at concurrency 1 and 8, and the mix vs llama-server's HTTP",
    "memory": "RSS per decoding session and per cached conversation, KV types as budgeted vs resident, 100 cached "
              "conversations' hit rate and lookup time",
}


def add_args(p: argparse.ArgumentParser, benches: dict = BENCHES) -> None:
    p.add_argument("which", choices=sorted(benches), help="; ".join(f"{k}: {v}" for k, v in benches.items()))
    p.add_argument("--preset", default="bench", choices=["tiny", "tiny-f16", "bench", "bench-32k", "bench-long"])
    p.add_argument("--model", help="a GGUF, or a packaged model by name (smollm2, smollm2-q8_0, smollm2-f16, "
                   "smollm2-q4_k_m), instead of the preset")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = all)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per session (gateway: its c1 and c8 "
                   "pairs' sessions, when above 64)")
    p.add_argument("--minutes", type=float, default=1.0, help="soak: how long")
    p.add_argument("--kill-every", type=float, default=10.0, help="soak: seconds between engine kills")
    p.add_argument("--phase-s", type=float, default=2.0, help="abuse: seconds per steady or abuse phase")
    p.add_argument("--rounds", type=int, default=3, help="abuse, layout, chat, burst, sampling, ticks, rpc, structured, gateway, "
                   "scale: rounds; overhead: passes over the six orders of its three sides (a round each)")
    p.add_argument("--kinds", help="abuse: only these abusers (comma-separated), to find which one hurts")
    p.add_argument("--modes", help="layout: modes to compare, the first the base (default streams,deterministic; "
                   "also unified)")
    p.add_argument("--levels", help="scale: only these concurrency levels beside llama-server (comma-separated), "
                   "nothing else; overhead: the concurrency levels to run (default 8)")
    p.add_argument("--node-args", default="", help="scale --levels: more `meshnode serve` arguments for the node, "
                   "e.g. --node-args=--no-deterministic")
    p.add_argument("--sides", help="gateway, spec: only these sides (gateway: comma-separated, e.g. 'c8 zmq,c8 http'; "
                   "spec: semicolon-separated, e.g. 'node det, spec off;llama-server, none'; default all)")
    p.add_argument("--draft-model", help="spec: a draft model (a GGUF or a packaged name) for the node's and "
                   "llama-server's draft sides")
    p.add_argument("--id-gaps", action="store_true", help="layout: also time packed vs gapped streams")
    p.add_argument("--llama-server", help="chat, burst, structured, gateway, scale, spec: a llama-server binary to "
                   "run side by side (README, "
                   "Benchmarks)")
    chat = p.add_argument_group("chat workload")
    chat.add_argument("--users", type=int, default=8)
    chat.add_argument("--turns", type=int, default=6)
    chat.add_argument("--system", type=int, default=200, help="system prompt tokens, the same for every user")
    chat.add_argument("--new", type=int, default=48, help="user tokens added each turn")
    chat.add_argument("--answer", type=int, default=24, help="tokens generated each turn")
    p.add_argument("--stock", help="kernels: a stock llama.cpp build folder (tools/build-llama-tools)")
    p.add_argument("--patched", help="kernels: a build folder of llama.cpp with patches/ (tools/build-llama-tools)")
    p.add_argument("--hostile", type=int, default=1000, help="hostile: random state edits and random frames a layout")
    p.add_argument("--dynamo-python", help="dynamo: a Python with ai-dynamo (Dynamo's frontend) installed")
    p.add_argument("--think-s", type=float, default=0.0, help="dynamo: seconds a user waits between an answer and "
                   "its next turn")
    p.add_argument("--json", help="also write the figures as JSON here")


def model_path(a) -> str:
    """--model: a GGUF, or a packaged model's name (smollm2 and its requantized copies); else the preset's."""
    if a.model:
        from meshnode.ops import realmodel

        return str(realmodel.real_model(a.model)) if a.model in realmodel.NAMES else a.model
    from meshnode.ops.models import cached_model

    return str(cached_model(a.preset))


def token_gaps(times: dict, lo: float, hi: float) -> list[float]:
    """Gaps in ms between consecutive tokens of the same session, for tokens that arrived in (lo, hi]."""
    import numpy as np

    out = []
    for ts in times.values():
        t = np.array(ts)
        idx = np.nonzero((t[1:] > lo) & (t[1:] <= hi))[0] + 1
        out += list((t[idx] - t[idx - 1]) * 1e3)
    return out


def steady_rate(times: list[list[float]]) -> tuple[float, float]:
    """Sessions decoding together, from the arrival times of each one's tokens: (aggregate tok/s, ms per
    decode tick), counted from the moment every session is past its prompt to the last token."""
    start = max(t[0] for t in times)
    end = max(t[-1] for t in times)
    after = [sum(1 for x in t if x > start) for t in times]
    return sum(after) / (end - start), (end - start) * 1e3 / max(1, max(after))


def streams(starts: list[float], times: list[list[float]], tokens: int | None = None) -> dict:
    """Sessions' streams from their submit times and each token's arrival: tokens, aggregate tok/s, the gaps
    between a session's tokens and its first-token delay (p50 and p99, ms). `tokens`: how many were
    generated, where a stream shows fewer than it made (llama-server holds back a token that ends inside a
    UTF-8 character)."""
    import numpy as np

    gaps = [g * 1e3 for ts in times for g in np.diff(ts)]
    ttft = [(ts[0] - t0) * 1e3 for t0, ts in zip(starts, times)]
    n = sum(map(len, times)) if tokens is None else tokens
    return {"tokens": n, "tok_s": n / (max(ts[-1] for ts in times) - min(starts)),
            "gap_p50_ms": float(np.percentile(gaps, 50)), "gap_p99_ms": float(np.percentile(gaps, 99)),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99))}


def llama_build() -> str:
    """Which llama.cpp build ran and on which CPU features (llama_print_system_info): figures from an AVX2-only
    machine and an AVX-512 one differ, and OpenMP or not changes how much CPU its idle threads take."""
    import llama_cpp

    from meshnode.engine.llamacpp import system_info

    return f"llama-cpp-python {llama_cpp.__version__}; {system_info().strip()}"


def run(a, package: str = "meshnode.bench") -> int:
    mod = importlib.import_module(f"{package}.{a.which}")
    return mod.main(a)
