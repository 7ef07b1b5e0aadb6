"""`python -m benchmarks dynamo --dynamo-python PY`: a multi-turn chat workload through NVIDIA Dynamo's OpenAI
frontend over two nodes (issue 68), beside one node alone.

Each side answers the same conversations (`--users` users, `--turns` turns, a shared system prompt, each turn
re-sending the history; temperature 0, `--answer` tokens) over HTTP with the openai SDK:
- `one node`: a node with its own gateway (`serve --http`), all its threads;
- `dynamo kv`: two nodes (half the threads each), a `meshnode dynamo-worker` for each (`--hf-folder` made from the
  GGUF), Dynamo's frontend with `--router-mode kv` (file discovery, loopback);
- `dynamo kv credit 4`: the router told to credit a held prefix 4x its default against load
  (`DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=4`: a conversation's turns then stay on the node that holds them);
- `dynamo round-robin`: the same with `--router-mode round-robin`;
- `dynamo kv node killed`: as `dynamo kv credit 4`, one node SIGKILLed once half the turns are answered, the frontend
  with `--migration-limit 3`: every request must still be answered (migrated, or refused with a reason).
`--think-s`: how long each user waits between an answer and its next turn (0: at once). `--sides`: only these
(comma-separated names). Printed per side: the prefix-hit rate (the answers' `cached_tokens` over their
`prompt_tokens`), the wall, the tokens each node generated, the failures. `PY` is a Python with `ai-dynamo` (the frontend; it installs only with
`pip install --no-deps ai-dynamo==1.6.1` and its dependencies) beside this one's `ai-dynamo-runtime`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.embed import up
from ipc.transport import free_tcp_port
from meshnode.bench import llama_build, model_path
from meshnode.dev.nodeproc import NodeProcess

LOOPBACK = {k: "127.0.0.1" for k in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST",
                                     "DYN_SYSTEM_HOST")}
SYSTEM = ("You are the mesh's assistant. Answer briefly and plainly. The mesh is a set of nodes that serve "
          "language models together; each node batches the requests it holds into one step of the model, keeps "
          "the computed prefix of every conversation for its next turn, and says no at once when it is full. ") * 2
ASKS = ["What does a node keep between turns?", "Why batch requests?", "What happens when a node is full?",
        "How is a conversation routed?", "What is a prefix?", "Say it again in one line.", "And why does it pay?",
        "What would you change?"]


def _run(base: str, model: str, users: int, turns: int, answer: int, halfway=None, think_s: float = 0.0) -> dict:
    import openai

    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    stats = {"prompt": 0, "cached": 0, "answered": 0, "failed": [], "done_turns": 0,
             "by_turn": [[0, 0] for _ in range(turns)]}  # per turn index: prompt tokens, cached tokens
    lock = threading.Lock()

    def user(u: int) -> None:
        msgs = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"(user {u}) {ASKS[(u + t) % len(ASKS)]}"})
            try:
                r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=answer, temperature=0)
            except openai.APIError as e:
                with lock:
                    stats["failed"].append(f"user {u} turn {t}: {type(e).__name__}: {str(e)[:120]}")
                return
            msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            time.sleep(think_s)  # a person reads the answer before the next turn
            details = r.usage.prompt_tokens_details
            with lock:
                cached = (details.cached_tokens or 0) if details else 0
                stats["prompt"] += r.usage.prompt_tokens
                stats["cached"] += cached
                stats["by_turn"][t][0] += r.usage.prompt_tokens
                stats["by_turn"][t][1] += cached
                stats["answered"] += 1
                stats["done_turns"] += 1
                if halfway and stats["done_turns"] == users * turns // 2:
                    halfway()

    t0 = time.monotonic()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stats["wall_s"] = time.monotonic() - t0
    stats["hit_rate"] = stats["cached"] / max(1, stats["prompt"])
    return stats


def _served(node) -> int:
    """The tokens a node has generated (its telemetry's counter), to see how the router split the work."""
    try:
        with node.client(timeout_s=10) as c:
            return int(c.status()["telemetry"]["decode_tokens_total"])
    except Exception:  # noqa: BLE001 - a killed node answers nothing
        return -1


def _mesh(a, path: str, threads: int, mode: str, kill: bool, router: dict) -> dict:
    run = tempfile.mkdtemp(prefix="meshnode-dynamo-")
    env = {**os.environ, **LOOPBACK, "DYN_FILE_KV": os.path.join(run, "discovery"), **router}
    events = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    port, procs = free_tcp_port(), []
    per = str(max(1, threads // 2))
    with NodeProcess(path, "--kv-events", events[0], "--threads", per, "--log-level", "WARNING") as n0, \
            NodeProcess(path, "--kv-events", events[1], "--threads", per, "--log-level", "WARNING") as n1:
        try:
            for i, (n, e) in enumerate(((n0, events[0]), (n1, events[1]))):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "meshnode", "dynamo-worker", "--node", n.listen, "--kv-events", e,
                     "--model-name", "m", "--hf-folder", os.path.join(run, "hf")], env=env,
                    stdout=open(os.path.join(run, f"worker{i}.log"), "w"), stderr=subprocess.STDOUT))
                time.sleep(2.0)  # the first writes the tokenizer folder the second reads
            procs.append(subprocess.Popen(
                [a.dynamo_python, "-m", "dynamo.frontend", "--discovery-backend", "file", "--router-mode", mode,
                 "--http-host", "127.0.0.1", "--http-port", str(port), "--kv-cache-block-size", "16",
                 "--migration-limit", "3"], env=env, stdout=open(os.path.join(run, "frontend.log"), "w"),
                stderr=subprocess.STDOUT))
            base = f"http://127.0.0.1:{port}"
            _models_up(base)
            halfway = (lambda: os.kill(n1.proc.pid, signal.SIGKILL)) if kill else None
            out = _run(base, "m", a.users, a.turns, a.answer, halfway, a.think_s)
            out["per_node"] = [_served(n0), _served(n1)]
            return out
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=30)


def _models_up(base: str, timeout_s: float = 120.0) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).json().get("data"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError("Dynamo's frontend listed no model")


def main(a) -> int:
    if not a.dynamo_python:
        print("bench dynamo: give --dynamo-python, a Python with ai-dynamo (the frontend) installed", file=sys.stderr)
        return 2
    a.model = a.model or "smollm2-q8_0"
    path, threads = model_path(a), a.threads or os.cpu_count()
    print(f"bench dynamo: {os.path.basename(path)}, {a.users} users x {a.turns} turns, answers of {a.answer}, "
          f"{a.think_s} s between a user's turns, "
          f"threads {threads} (two nodes: half each); {llama_build()}", flush=True)
    credit = {"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "4"}  # a held prefix outweighs load 4x (Dynamo's default 1)
    sides = (("dynamo kv", "kv", False, {}), ("dynamo kv credit 4", "kv", False, credit),
             ("dynamo round-robin", "round-robin", False, {}), ("dynamo kv node killed", "kv", True, credit))
    rounds = []
    for k in range(max(1, a.rounds)):  # every side once a round, in turn: the machine's drift hits all alike
        rows = {}
        port = free_tcp_port()
        with NodeProcess(path, "--http", f"127.0.0.1:{port}", "--threads", str(threads), "--log-level", "WARNING") as n:
            up(f"http://127.0.0.1:{port}")
            rows["one node"] = _run(f"http://127.0.0.1:{port}", "m", a.users, a.turns, a.answer, think_s=a.think_s)
            rows["one node"]["per_node"] = [_served(n)]
        for name, mode, kill, router in sides:
            if not a.sides or name in a.sides.split(","):
                rows[name] = _mesh(a, path, threads, mode, kill, router)
        print(f"\nround {k + 1}\n{'side':26s} {'hit rate':>8s} {'wall s':>7s} {'answered':>8s} {'per node':>12s} "
              "failed")
        for name, r in rows.items():
            print(f"{name:26s} {r['hit_rate']:8.1%} {r['wall_s']:7.1f} {r['answered']:8d} {str(r['per_node']):>12s} "
                  f"{len(r['failed'])}")
            for f in r["failed"]:
                print(f"    {f}")
            print("    hit rate by turn: " + " ".join(f"{c / max(1, p):.0%}" for p, c in r["by_turn"]), flush=True)
        rounds.append(rows)
    print()
    for name in rounds[0]:
        if name == "one node":
            continue
        hits = sorted(r[name]["hit_rate"] / max(r["one node"]["hit_rate"], 1e-9) for r in rounds)
        walls = sorted(r[name]["wall_s"] / r["one node"]["wall_s"] for r in rounds)
        lost = sum(len(r[name]["failed"]) + (a.users * a.turns - r[name]["answered"]) for r in rounds)
        print(f"{name}: prefix hits {hits[len(hits) // 2]:.2f}x one node's (rounds "
              f"{', '.join(f'{h:.2f}' for h in hits)}; goal >= 0.90 for kv), wall {walls[len(walls) // 2]:.2f}x "
              f"(rounds {', '.join(f'{w:.2f}' for w in walls)}), unanswered {lost}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "build": llama_build(), "think_s": a.think_s, "rounds": rounds}, f, indent=1)
    return 0
