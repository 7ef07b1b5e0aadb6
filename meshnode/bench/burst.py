"""A prompt burst against sessions already decoding: do they stall, and how soon do the prompts start?

4 sessions decode steadily; then 4 new sessions arrive with 1,000-token prompts. Each
round runs, side by side: the node with its default settings (prefill sized by a tick
target of 8 decode ticks), the node allowed whole-batch ticks (prompt chunks as large as a
tick carries, the streams waiting for each: the other end of the trade the target makes),
the node with the old fixed 64-token chunk, and, given `--llama-server PATH`, llama.cpp's
server with 8 slots. Measured: the in-flight sessions' inter-token gaps steady and during
the burst, and each burst prompt's first-token delay. On the node, the `capacity` estimate
of a 1,000-token prompt's first-token delay is also checked against the measured delay: on
the idle node (a lone prompt) and on the busy one (the first burst prompt).
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

from meshnode.bench import llama_build, model_path, token_gaps
from meshnode.bench.llama_server import LlamaServer, Stop
from meshnode.dev.nodeproc import NodeProcess
from meshnode.ops.config import NodeConfig

BURST_PROMPT, STEADY, CTX = 1000, 4, 8192  # 4 x (8 + 1000) + 4 x (1000 + 4) cells fit 8192
STEADY_TOKENS = 100  # per steady session before the burst: 400 gaps, so p99 is not just the largest one
FIXED = ("--tick-target-ms", "0", "--prefill-chunk", "64")
# a target no tick with prompt rows reaches: each carries the prefill room (n_batch - max_batch), as
# llama-server's batches carry its 512-row ubatches, and the streams wait for it
WHOLE_BATCH = ("--tick-target-ms", "60000")


def steady_prompt(i: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7 + k + salt * 101) % 500 for k in range(8)]


def burst_prompt(i: int, salt: int = 0) -> list[int]:
    """`salt`: another prompt for each round where a server lives through rounds (its prompt cache)."""
    return [3 + (i * 31 + k * 13 + salt * 101) % 500 for k in range(BURST_PROMPT)]


def summary(times: dict, first: dict, t_burst: float, t_end: float, sizes: dict | None = None) -> dict:
    """`times`: each steady session's token events' arrival times; `sizes`: the tokens each event carried (a
    node's decode tick of several steps sends them together; None: not known, as over the gateway's HTTP).
    The gaps are between events, what a reader sees; `steady_tok_s` is each stream's tokens per second
    before the burst (median), where the sizes are known."""
    steady, burst = token_gaps(times, 0, t_burst), token_gaps(times, t_burst, t_end)
    ttft = sorted((first[s] - t_burst) * 1e3 for s in first)
    rates = []
    for sid, ts in (times.items() if sizes is not None else ()):
        n = [k for t, k in zip(ts, sizes[sid]) if t <= t_burst]
        rates.append((sum(n) - n[0]) / (ts[len(n) - 1] - ts[0]))
    return {**({"steady_tok_s": float(np.median(rates))} if rates else {}), "steady_itl_ms_p50": float(np.percentile(steady, 50)), "steady_itl_ms_p99": float(np.percentile(steady, 99)),
            "burst_itl_ms_p99": float(np.percentile(burst, 99)) if burst else 0.0,
            "burst_itl_ms_max": float(max(burst)) if burst else 0.0,
            "burst_ttft_ms_first": ttft[0], "burst_ttft_ms_mean": float(np.mean(ttft)), "burst_ttft_ms_max": ttft[-1]}


def one(path: str, threads: int, chunk: int | None = None, extra: tuple = (), python: str | None = None,
        probes: bool = False) -> dict:
    """The burst through a fresh node; `chunk`: the most prompt tokens per tick (None: the default)."""
    args = ["--max-active", "8", "--ctx", str(CTX), "--threads", str(threads), "--log-level", "WARNING", *extra]
    if chunk is not None:
        args += ["--prefill-chunk", str(chunk), "--n-batch", str(max(512, chunk + 8))]
    est = {}
    with NodeProcess(path, *args, python=python) as node, node.client(timeout_s=600) as c:
        if probes:  # the node learns its tick cost on a small job, then estimates a lone 1000-token prompt
            c.generate("warm", tokens=steady_prompt(9) * 5, max_tokens=24, ignore_eos=True)
            est["idle_estimate_ms"] = c.status(BURST_PROMPT)["capacity"]["ttft_ms_estimate"]
            r = c.generate("idle", tokens=burst_prompt(9), max_tokens=1, ignore_eos=True)
            est["idle_measured_ms"] = r.done["usage"]["ttft_ms"]
        steady = [f"s{i}" for i in range(STEADY)]
        for i, sid in enumerate(steady):
            c.submit(sid, tokens=steady_prompt(i), max_tokens=1000, ignore_eos=True)
        times: dict[str, list[float]] = {sid: [] for sid in steady}
        sizes: dict[str, list[int]] = {sid: [] for sid in steady}
        first: dict[str, float] = {}
        done_ttft: dict[str, float] = {}

        def pump(until) -> None:
            while not until():
                ev = c.recv(600)
                if ev is None:
                    raise TimeoutError("node stopped answering")
                sid = ev.get("id")
                if ev["event"] == "tokens":
                    if sid in times:
                        times[sid].append(time.monotonic())
                        sizes[sid].append(len(ev["tokens"]))
                    elif sid not in first:
                        first[sid] = time.monotonic()
                elif ev["event"] == "done" and sid == "b0":
                    done_ttft[sid] = ev["usage"]["ttft_ms"]

        pump(lambda: min(len(t) for t in times.values()) >= STEADY_TOKENS)  # steady state
        if probes:
            est["busy_estimate_ms"] = c.status(BURST_PROMPT)["capacity"]["ttft_ms_estimate"]
        t_burst = time.monotonic()
        burst = [f"b{i}" for i in range(4)]
        for i, sid in enumerate(burst):
            c.submit(sid, tokens=burst_prompt(i), max_tokens=4, ignore_eos=True)
        pump(lambda: len(first) == len(burst) and "b0" in done_ttft)
        t_end = time.monotonic()
        for sid in steady:
            c.cancel(sid)
        model = c.status()["capacity"]["tick_model"] if probes else None
    out = dict(summary(times, first, t_burst, t_end, sizes), chunk=chunk)
    if model:
        out["tick_model"] = model  # what the node learned: costs, the correction, ticks that ran far over
    if probes:
        est["busy_measured_ms"] = done_ttft["b0"]  # node-side, from the submit's arrival, like the estimate
        out.update(est)
    return out


def through_llama_server(binary: str, path: str, threads: int) -> dict:
    with LlamaServer(binary, path, threads, slots=8, ctx=CTX) as server:
        return burst_with(server.complete, one_token_chunks=True)


def burst_with(complete, salt: int = 0, one_token_chunks: bool = False) -> dict:
    """The burst through an HTTP server: `complete(prompt, n, on_token)` streams one greedy request past EOS,
    calling `on_token(time)` per chunk of text, which raises Stop to hang up (llama-server's or the gateway's).
    `one_token_chunks`: each chunk is one token (llama-server's), so the streams' tokens a second are known."""
    times: dict[str, list[float]] = {f"s{i}": [] for i in range(STEADY)}
    first: dict[str, float] = {}
    stop = threading.Event()

    def steady(i: int) -> None:
        def on_token(now: float) -> None:
            times[f"s{i}"].append(now)
            if stop.is_set():
                raise Stop
        complete(steady_prompt(i, salt), 1000, on_token)

    def burst(i: int) -> None:
        complete(burst_prompt(i, salt), 4, lambda now: first.setdefault(f"b{i}", now))

    workers = [threading.Thread(target=steady, args=(i,)) for i in range(STEADY)]
    for w in workers:
        w.start()
    while min(len(t) for t in times.values()) < STEADY_TOKENS:
        time.sleep(0.01)
    t_burst = time.monotonic()
    bursts = [threading.Thread(target=burst, args=(i,)) for i in range(4)]
    for w in bursts:
        w.start()
    for w in bursts:
        w.join()
    t_end = time.monotonic()
    stop.set()
    for w in workers:
        w.join()
    return summary(times, first, t_burst, t_end, {s: [1] * len(t) for s, t in times.items()} if one_token_chunks
                   else None)


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    print(f"model {os.path.basename(path)}: {STEADY} sessions decoding, then 4 arrive with {BURST_PROMPT}-token "
          f"prompts; threads {threads}, {llama_build()}")
    runs = {"node": lambda: one(path, threads, probes=True),
            "node_whole_batch": lambda: one(path, threads, extra=WHOLE_BATCH),
            "node_fixed_64": lambda: one(path, threads, extra=FIXED)}
    if a.llama_server:
        runs["llama_server"] = lambda: through_llama_server(a.llama_server, path, threads)
    names, rounds = list(runs), []
    for r in range(a.rounds):  # the order rotates, so the machine's drift does not favour one run
        order = names[r % len(names):] + names[:r % len(names)]
        got = {name: runs[name]() for name in order}
        rounds.append({name: got[name] for name in names})
        row = rounds[-1]
        print(f"round {r + 1}")
        for name, f in row.items():
            print(f"  {name:<14} steady {f['steady_tok_s']:5.1f} tok/s, gap p50 {f['steady_itl_ms_p50']:6.1f} "
                  f"p99 {f['steady_itl_ms_p99']:6.1f} ms"
                  f"  burst worst gap {f['burst_itl_ms_max']:8.0f} ms  burst TTFT first {f['burst_ttft_ms_first']:7.0f}"
                  f" last {f['burst_ttft_ms_max']:7.0f} ms")
        n = row["node"]
        print(f"  capacity estimate vs measured: idle {n['idle_estimate_ms']} vs {n['idle_measured_ms']:.0f} ms, "
              f"busy {n['busy_estimate_ms']} vs {n['busy_measured_ms']:.0f} ms")
        m = n["tick_model"]
        print(f"  node's tick model after the burst: correction {m['correction']} (sizing {m['correction_bound']}), "
              f"ticks over twice their prediction: {m['outliers_total']}")
    verdicts = targets(rounds)
    for line in verdicts:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "burst_prompt": BURST_PROMPT,
                       "tick_target_ms": NodeConfig().tick_target_ms, "tick_target_ratio": NodeConfig().tick_target_ratio,
                       "steady_tokens": STEADY_TOKENS,
                       "llama_server": a.llama_server, "rounds": rounds, "verdicts": verdicts}, f, indent=2)
    return 0


def targets(rounds: list[dict]) -> list[str]:
    """Each target per round: met in how many, and its worst and median round."""
    def err(n, k):
        e = n[f"{k}_estimate_ms"]
        return abs(e - n[f"{k}_measured_ms"]) / n[f"{k}_measured_ms"] if e is not None else float("inf")

    nodes = [r["node"] for r in rounds]
    checks = [("steady ITL p99 / p50", [n["steady_itl_ms_p99"] / n["steady_itl_ms_p50"] for n in nodes], 1.5, ".2f"),
              ("worst in-flight gap / steady ITL p50", [n["burst_itl_ms_max"] / n["steady_itl_ms_p50"] for n in nodes],
               10.0, ".1f"),
              ("capacity estimate error (worse of idle, busy)",
               [max(err(n, "idle"), err(n, "busy")) for n in nodes], 0.25, ".0%")]
    if "llama_server" in rounds[0]:
        checks += [("worst in-flight gap, node / llama-server",
                    [r["node"]["burst_itl_ms_max"] / r["llama_server"]["burst_itl_ms_max"] for r in rounds], 0.05, ".3f"),
                   ("last burst first token, node / llama-server",
                    [r["node"]["burst_ttft_ms_max"] / r["llama_server"]["burst_ttft_ms_max"] for r in rounds], 1.0, ".2f")]
        if "node_whole_batch" in rounds[0]:  # what the default's gap bound costs: the same node, ticks unbounded
            checks += [("last burst first token, whole-batch node / llama-server",
                        [r["node_whole_batch"]["burst_ttft_ms_max"] / r["llama_server"]["burst_ttft_ms_max"]
                         for r in rounds], 1.0, ".2f"),
                       ("worst in-flight gap / steady ITL p50, whole-batch node",
                        [r["node_whole_batch"]["burst_itl_ms_max"] / r["node_whole_batch"]["steady_itl_ms_p50"]
                         for r in rounds], 10.0, ".1f")]
        # a gap per event: the node's multi-step ticks send a few tokens in one, so its gaps are not
        # llama-server's (one token each); what the streams get is compared by tokens a second
        checks += [("steady tokens/s per stream, llama-server / node",
                    [r["llama_server"]["steady_tok_s"] / r["node"]["steady_tok_s"] for r in rounds], 1.05, ".2f")]
    out = []
    for name, vals, bound, fmt in checks:
        met = sum(v <= bound for v in vals)
        out.append(f"{name}: rounds {', '.join(format(v, fmt) for v in vals)}; median {format(float(np.median(vals)), fmt)}"
                   f" (target <= {format(bound, fmt)}: met in {met} of {len(vals)} rounds)")
    return out
