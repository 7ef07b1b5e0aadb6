"""`python -m benchmarks rpc`: what spreading a model over ggml RPC workers costs, and what batching buys back.

The bench model through a node, side by side in rounds whose order rotates:
- local: every layer on the node's own CPU;
- 1 worker: the last 7 of 13 layers (the output layer counts) on one `meshnode rpc-worker`;
- 2 workers: the last 9 split 1:1 over two workers;
- 2 workers behind a delay proxy at 0, 0.2, 1 and 5 ms round trip (meshnode/dev/rpcproc.py: this VM's
  kernel has no netem, so a Python hop holds every chunk half the RTT each way; its 0 ms run is the
  baseline the delays are read against).
Each runs three workloads: one session decoding (tok/s at concurrency 1), eight decoding together
(aggregate tok/s at concurrency 8) and one 512-token prompt (prefill tok/s = 512 / its first token).

Where the time goes: a decode tick crosses to each worker and back a fixed number of times whatever
the batch (graph compute, activations in and out), so the ms a tick gains per ms of RTT, fitted over
the delays, is the round trips a tick costs; the bytes are small (one f32 row of n_embd per token per
device boundary). Batching shares those round trips among the sessions of a tick: the concurrency-8 /
concurrency-1 ratio at each RTT is what it buys. All processes share this host's cores, so the
workers' compute competes with the node's (a real deployment puts them on other hosts).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from meshnode.bench import llama_build, model_path, steady_rate
from meshnode.dev.nodeproc import NodeProcess
from meshnode.dev.rpcproc import DelayProxy, RpcWorker

NEW, PROMPT = 48, 512
DELAYS_MS = (0.0, 0.2, 1.0, 5.0)  # round trips through the proxy
SPLITS = {"local": (0, ()), "1 worker": (1, ("--gpu-layers", "7")),
          "2 workers": (2, ("--gpu-layers", "9", "--tensor-split", "1,1"))}


def sides() -> dict:
    """Side name -> (workers, node flags, proxy RTT in ms or None)."""
    out = {name: (n, flags, None) for name, (n, flags) in SPLITS.items()}
    for rtt in DELAYS_MS:
        out[f"2 workers, {rtt:g} ms RTT"] = (*SPLITS["2 workers"], rtt)
    return out


def one(path: str, threads: int, n_workers: int, flags: tuple, rtt_ms: float | None) -> dict:
    workers = [RpcWorker(threads=threads).start() for _ in range(n_workers)]
    proxies = [DelayProxy(w.endpoint, rtt_ms / 2) for w in workers] if rtt_ms is not None else []
    endpoints = [p.endpoint for p in proxies] or [w.endpoint for w in workers]
    args = ["--threads", str(threads), "--log-level", "WARNING", "--max-active", "8", *flags,
            *(["--rpc", ",".join(endpoints)] if endpoints else [])]
    try:
        with NodeProcess(path, *args) as node, node.client(timeout_s=900) as c:
            c.generate("warm", tokens=[3, 4, 5], max_tokens=2)
            devices = c.status()["node"]["devices"]
            lone = _decode(c, 1)
            eight = _decode(c, 8)
            t0 = time.perf_counter()
            r = c.generate("prefill", tokens=[3 + k % 500 for k in range(PROMPT)], max_tokens=1)
            ttft = r.token_times[0] - t0
            ticks = c.status()["telemetry"]["engine"]
    finally:
        for p in proxies:
            p.close()
        for w in workers:
            w.kill()
    return {"c1_tok_s": lone[0], "c1_ms_per_tick": lone[1], "c8_tok_s": eight[0], "c8_ms_per_tick": eight[1],
            "prefill_tok_s": PROMPT / ttft, "tokens_c1": lone[2], "step_ms_p50": ticks.get("step_ms_p50"),
            "layers": {d["name"]: d["layers"] for d in devices}}


def _decode(c, n: int) -> tuple[float, float, list]:
    """Aggregate tok/s of `n` sessions from their first tokens to the last, and ms per decode tick."""
    ids = [f"d{n}-{i}" for i in range(n)]
    for i, sid in enumerate(ids):
        c.submit(sid, tokens=[3 + i, 4, 5, 6], max_tokens=NEW, ignore_eos=True)
    res = c.collect(ids, timeout_s=900)
    return (*steady_rate([r.token_times for r in res.values()]), res[ids[0]].tokens)


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    print(f"bench rpc: {os.path.basename(path)}, {NEW} new tokens, {PROMPT}-token prefill, {a.rounds} rounds; "
          f"{llama_build()}", flush=True)
    runs: dict[str, list[dict]] = {k: [] for k in sides()}
    names = list(runs)
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            n, flags, rtt = sides()[name]
            res = one(path, threads, n, flags, rtt)
            runs[name].append(res)
            print(f"  round {r + 1} {name:<24} c1 {res['c1_tok_s']:6.1f} tok/s ({res['c1_ms_per_tick']:6.1f} ms/tick)"
                  f"  c8 {res['c8_tok_s']:6.1f} tok/s ({res['c8_ms_per_tick']:6.1f} ms/tick)  prefill "
                  f"{res['prefill_tok_s']:7.1f} tok/s", flush=True)
    summary = _summary(runs)
    print(json.dumps(summary["table"], indent=1))
    for line in summary["verdict"]:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"build": llama_build(), "runs": runs, **summary}, f, indent=1)
    return 0


def _summary(runs: dict) -> dict:
    med = {name: {k: float(np.median([r[k] for r in rs])) for k in ("c1_tok_s", "c8_tok_s", "prefill_tok_s",
                                                                     "c1_ms_per_tick", "c8_ms_per_tick")}
           for name, rs in runs.items()}
    local = med["local"]
    table = {name: {**m, "c1_vs_local": m["c1_tok_s"] / local["c1_tok_s"], "c8_vs_local": m["c8_tok_s"] / local["c8_tok_s"],
                    "prefill_vs_local": m["prefill_tok_s"] / local["prefill_tok_s"], "c8_over_c1": m["c8_tok_s"] / m["c1_tok_s"]}
             for name, m in med.items()}
    rtts = [(rtt, med[f"2 workers, {rtt:g} ms RTT"]) for rtt in DELAYS_MS]
    x = np.array([rtt for rtt, _ in rtts])
    trips = {k: float(np.polyfit(x, [m[f"{k}_ms_per_tick"] for _, m in rtts], 1)[0]) for k in ("c1", "c8")}
    same = all(r["tokens_c1"] == runs["local"][0]["tokens_c1"] for rs in runs.values() for r in rs)
    verdict = [f"medians of {len(runs['local'])} rounds; every side's greedy tokens {'identical to' if same else 'DIFFER from'} local",
               f"a decode tick costs {trips['c1']:.1f} (one session) and {trips['c8']:.1f} (eight) ms per ms of RTT: "
               "that many round trips to the workers per tick, whatever the batch",
               *(f"at {rtt:g} ms RTT: c1 {m['c1_tok_s']:.1f} tok/s, c8 {m['c8_tok_s']:.1f} tok/s ({m['c8_tok_s'] / m['c1_tok_s']:.1f}x "
                 f"from batching), prefill {m['prefill_tok_s']:.0f} tok/s" for rtt, m in rtts)]
    return {"table": table, "round_trips_per_tick": trips, "verdict": verdict}
