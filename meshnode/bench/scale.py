"""`meshnode bench scale`: what the node itself costs per tick as sessions grow, apart from llama.cpp.

- the node's own time per tick: a node whose engine is the fake one sleeping a fixed 5 ms a step (what
  a fast GPU tick takes, its own stand-in model inside the 5), N sessions decoding together (N = 1, 8, 32,
  64): every ms a tick takes beyond the 5 is the front, the link and the engine process's Python;
- the policy alone: the scheduler's plan() and apply() in this process, with an engine that costs
  nothing but reports 5 ms ticks (so the cost model refits as often as on such ticks), as the decoding
  sessions grow.
- KV per type (f16, q8_0, q4_0 for K and V) on the bench model (or --model): the bytes a token takes as the
  budget counts them, beside the KV buffer llama.cpp itself allocated (its load log), and how many
  sessions of 4,096 tokens fit 4 GiB of KV.
With `--llama-server PATH`, also concurrency 1-64 and depth 512-16k beside llama-server
(meshnode/bench/scale_peers.py). Memory per session and per cached conversation: `meshnode bench memory`.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from meshnode.bench import llama_build, model_path, steady_rate
from meshnode.bench.memory import kv_types
from meshnode.dev.nodeproc import NodeProcess

STEP_MS = 5.0
LEVELS = (1, 8, 32, 64)
NEW = 200


def node_overhead(n: int) -> dict:
    internal = {"engine_kind": "fake", "fake": {"step_s": STEP_MS / 1e3, "n_seq_max": 64, "n_ctx": 64 * 1024}}
    with NodeProcess(None, "--max-active", "64", "--log-level", "WARNING", internal=internal) as node, \
            node.client(timeout_s=600) as c:
        c.generate("warm", tokens=[3, 4, 5], max_tokens=2)
        ids = [f"s{i}" for i in range(n)]
        for i, sid in enumerate(ids):
            c.submit(sid, tokens=[3 + i, 4, 5], max_tokens=NEW, ignore_eos=True)
        res = c.collect(ids)
    ms = steady_rate([r.token_times for r in res.values()])[1]
    return {"ms_per_tick": ms, "node_ms_per_tick": ms - STEP_MS, "node_share_of_5ms": (ms - STEP_MS) / STEP_MS}


def policy(n: int, ticks: int = 300) -> dict:
    from meshnode.core.budget import NodeBudget
    from meshnode.core.scheduler import Scheduler
    from meshnode.core.session import Session
    from meshnode.dev.fake import FakeEngine
    from meshnode.ops.config import scheduler_config

    e = FakeEngine(n_seq_max=64, n_ctx=64 * 1024, cost_ms=lambda plan: STEP_MS)  # the cost model refits as on 5 ms ticks
    sched = Scheduler(NodeBudget.from_engine(e, max_active=64, max_batch_size=64), e.eog, scheduler_config(),
                      recipe=e.recipe_fingerprint)
    for i in range(n):
        assert sched.submit(Session(f"s{i}", [3 + i, 4, 5], 1000, ignore_eos=True)).accepted
    plan_us, apply_us = [], []
    for _ in range(ticks + 20):
        t0 = time.perf_counter()
        tick = sched.plan()
        t1 = time.perf_counter()
        res = e.step(tick.plan)
        t2 = time.perf_counter()
        sched.apply(tick, res)
        t3 = time.perf_counter()
        plan_us.append((t1 - t0) * 1e6)
        apply_us.append((t3 - t2) * 1e6)
    # means, not medians: apply()'s cost model refit runs one tick in several, and its CPU counts all the same
    return {"plan_us_mean": float(np.mean(plan_us[20:])), "apply_us_mean": float(np.mean(apply_us[20:]))}


def main(a) -> int:
    if a.levels:
        return peers_only(a)
    print(f"bench scale: the node's own cost per tick over a fake engine of {STEP_MS:g} ms, {a.rounds} rounds; "
          f"{llama_build()}", flush=True)
    runs: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        for n in LEVELS[r % len(LEVELS):] + LEVELS[:r % len(LEVELS)]:
            got = {**node_overhead(n), **policy(n)}
            runs.setdefault(str(n), []).append(got)
            print(f"  round {r + 1} {n:>2} sessions: {got['ms_per_tick']:6.2f} ms a tick, the node's "
                  f"{got['node_ms_per_tick']:5.2f} ms ({got['node_share_of_5ms']:.0%} of {STEP_MS:g} ms); plan "
                  f"{got['plan_us_mean']:.0f} us, apply {got['apply_us_mean']:.0f} us", flush=True)
    med = {n: {k: float(np.median([x[k] for x in rs])) for k in rs[0]} for n, rs in runs.items()}
    for n, m in med.items():
        print(f"median {n:>2} sessions: the node's own {m['node_ms_per_tick']:.2f} ms a tick "
              f"({m['node_share_of_5ms']:.0%} of a {STEP_MS:g} ms tick); plan {m['plan_us_mean']:.0f} us, "
              f"apply {m['apply_us_mean']:.0f} us")
    kv = kv_types(model_path(a))
    for t, k in kv.items():
        print(f"KV {t}: {k['kv_bytes_per_token']} B a token as budgeted; the budget {k['budget_bytes']} B vs llama.cpp's "
              f"buffer {k['llama_cpp_kv_bytes']} B ({k['budget_over_llama_cpp']:.3f}x); {k['sessions_of_4096_in_4gib']} "
              "sessions of 4,096 tokens in 4 GiB")
    peers = None
    if a.llama_server:
        from meshnode.bench import scale_peers
        from meshnode.ops.models import cached_model

        deep = None if a.model else str(cached_model("bench-long"))
        print(f"beside llama-server: {model_path(a)}, depth on {deep or 'none (--model given)'}", flush=True)
        peers = scale_peers.run(a, model_path(a), a.threads or os.cpu_count(), deep)
        peers["verdicts"] = scale_peers.verdicts(peers)
        for line in peers["verdicts"]:
            print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"build": llama_build(), "step_ms": STEP_MS, "runs": runs, "median": med, "kv_types": kv,
                       "peers": peers}, f, indent=1)
    return 0


def peers_only(a) -> int:
    """`--levels`: only these concurrency levels beside llama-server (no depth), the node with `--node-args`:
    a quick look at one level under another setting."""
    from meshnode.bench import scale_peers

    if not a.llama_server:
        raise SystemExit("bench scale --levels: needs --llama-server PATH")
    extra = tuple(a.node_args.split())
    print(f"bench scale: levels {a.levels} beside llama-server, node args {list(extra)}, {a.rounds} rounds; "
          f"{llama_build()}", flush=True)
    peers = scale_peers.run(a, model_path(a), a.threads or os.cpu_count(), None,
                            levels=[int(x) for x in a.levels.split(",")], extra=extra)
    peers["verdicts"] = scale_peers.verdicts(peers)
    for line in peers["verdicts"]:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"build": llama_build(), "peers": peers}, f, indent=1)
    return 0
