"""What the process split costs: the full node vs the engine in-process, same scheduler.

The same 16 jobs (prompts 4 to 100 tokens, 32 new tokens, concurrency 8) run
through Scheduler + LlamaEngine in this process, through a real node (front +
engine processes, ZeroMQ, msgpack, shared memory) with its default pipelined
ticks, and through a node in lockstep (--pipeline-depth 1), which shows what
the pipeline buys.

Each side is started once and kept, as a serving node is, and every round
runs the three in one of the six orders, so drift on a shared machine hits all
sides alike; each round's prompts are new (its own salt), so no side finds a
round's prompts in its prefix cache, and a round no one counts first lets each
side's cost model and pipeline learn, as a serving node's have. Until stop 65
every run started its side afresh: a run then cost a node's start as well, so
a level held 6 rounds where it now holds 18 in about the same time, and single
runs swing by 10 % on these machines. The verdict uses all runs together (total
tokens over total time), beside the median of the rounds' ratios.

The per-tick front + IPC figure is measured inside the engine process: the
time between two engine steps, from one step's result being ready to the next
step starting. Everything the node adds to the loop that is not the engine's
own work sits there unless it overlaps a decode: with pipelining the front
plans while the engine decodes, and the engine's link threads read, send and
measure memory while it decodes (meshnode/worker/link_io.py), so what remains
is the hand-over between threads and filling in the sampled tokens.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import time

from meshnode.bench import llama_build, model_path
from meshnode.core.budget import NodeBudget
from meshnode.core.scheduler import Scheduler
from meshnode.core.session import Session
from meshnode.core.telemetry import WAIT_WINDOW
from meshnode.dev.drive import run_to_completion
from meshnode.dev.nodeproc import NodeProcess
from meshnode.engine.llama import LlamaEngine
from meshnode.ops.config import NodeConfig

CONCURRENCY, N_JOBS = 8, 16
SIDES = ("in-process", "node", "lockstep")
ORDERS = list(itertools.permutations(SIDES))  # a pass: each side first, second and third equally often


def jobs(new_tokens: int) -> list[tuple[str, list[int], int]]:
    lens = [4 + (96 * i) // (N_JOBS - 1) for i in range(N_JOBS)]  # 4 .. 100
    return [(f"j{i}", [3 + (i * 53 + k * 11) % 509 for k in range(n)], new_tokens) for i, n in enumerate(lens)]


def salted(work, r: int) -> list[tuple[str, list[int], int]]:
    """Round `r`'s jobs: the same lengths under new ids and new tokens, so a kept side's prefix cache holds none
    of them."""
    return [(f"{sid}-r{r}", [3 + (t - 3 + 37 * r) % 509 for t in toks], n) for sid, toks, n in work]


class _Timed:
    """The engine, adding up its own step time so wall time splits into engine and the rest."""

    def __init__(self, engine: LlamaEngine):
        self.engine, self.step_ms = engine, 0.0

    def step(self, plan):
        res = self.engine.step(plan)
        self.step_ms += res.step_ms
        return res


class InProcess:
    """The engine as a node configures it by default (`meshnode serve --ctx 4096`: streams, deterministic
    where it holds, speculation), driven by the same scheduler in this process, both kept across runs as the
    node keeps its own."""

    def __init__(self, path: str, threads: int, concurrency: int = CONCURRENCY):
        cfg = NodeConfig(model=path, ctx=4096, threads=threads, max_active=concurrency)
        resolved = cfg.resolve()
        self.engine = LlamaEngine(resolved.engine)
        # the node's own budget (resolved.budget): its prefill room is what a tick has beside the decode rows,
        # not from_engine's bare 64 tokens, which cut the in-process side's prompts into several ticks the node
        # runs in one
        budget = NodeBudget.from_engine(self.engine, resolved.budget, max_active=concurrency, max_queue=N_JOBS)
        self.sched = Scheduler(budget, self.engine.eog, resolved.scheduler, recipe=self.engine.recipe_fingerprint,
                               deterministic=self.engine.deterministic)
        self.sched.calibrated(self.engine.calibrate())  # as the node's engine does before its first client

    def run(self, work) -> dict:
        timed, ticks0 = _Timed(self.engine), self.sched.counters.ticks
        t0 = time.perf_counter()
        for sid, toks, n in work:
            self.sched.submit(Session(sid, toks, n, ignore_eos=True))
        events = run_to_completion(self.sched, timed)
        wall = time.perf_counter() - t0
        out = {e.session.key: e.tokens for e in events if e.kind == "done"}
        return {"wall_s": wall, "ticks": self.sched.counters.ticks - ticks0, "tokens": out, "step_ms": timed.step_ms,
                "gen_tok_s": sum(map(len, out.values())) / wall}

    def close(self) -> None:
        self.engine.close()


def node_args(threads: int, concurrency: int, depth: int, queue: int = N_JOBS, extra: tuple = ()) -> list[str]:
    return ["--max-active", str(concurrency), "--max-queue", str(queue), "--threads", str(threads),
            "--ctx", "4096", "--log-level", "WARNING", "--pipeline-depth", str(depth), *extra]


def warm(c) -> None:
    c.generate("warm", tokens=[3, 4, 5], max_tokens=2)  # page weights in, like the in-process engine


def on_node(c, work) -> dict:
    """`work` through a running node's client, with the engine's own figures for the run from its telemetry."""
    t = c.status()["telemetry"]
    ticks0, step0 = t["ticks_total"], t["engine"]["step_ms_total"]
    gap0, gaps0 = t["engine"]["busy_gap_ms_total"], t["engine"]["busy_gaps"]
    t0 = time.perf_counter()
    for sid, toks, n in work:
        c.submit(sid, tokens=toks, max_tokens=n, ignore_eos=True)
    res = c.collect([w[0] for w in work], timeout_s=600)
    wall = time.perf_counter() - t0
    t = c.status()["telemetry"]
    e = t["engine"]
    out = {sid: r.tokens for sid, r in res.items()}
    return {"wall_s": wall, "ticks": t["ticks_total"] - ticks0, "tokens": out, "step_ms": e["step_ms_total"] - step0,
            "wait_us_mean": (e["busy_gap_ms_total"] - gap0) / max(1, e["busy_gaps"] - gaps0) * 1e3,
            "wait_us_p50": e["wait_us_p50"], "wait_us_p90": e["wait_us_p90"],
            "gen_tok_s": sum(map(len, out.values())) / wall}


def through_node(path: str, threads: int, work, depth: int = 2, extra: tuple = (), python: str | None = None,
                 concurrency: int = CONCURRENCY) -> dict:
    """`work` through a node started for it (other benches' one-off runs)."""
    args = node_args(threads, concurrency, depth, len(work), extra)
    with NodeProcess(path, *args, python=python) as node, node.client(timeout_s=600) as c:
        warm(c)
        return on_node(c, work)


def _non_engine_us(r: dict) -> float:
    """Wall time (the client's view) minus the engine's step time, per tick."""
    return (r["wall_s"] * 1e3 - r["step_ms"]) / r["ticks"] * 1e3


def _ratio_all(runs: list[dict], base: list[dict]) -> float:
    """Total tokens over total time, one side against the other."""
    tok_s = lambda rs: sum(r["gen_tok_s"] * r["wall_s"] for r in rs) / sum(r["wall_s"] for r in rs)  # noqa: E731
    return tok_s(runs) / tok_s(base)


def main(a) -> int:
    levels = [int(x) for x in (a.levels or str(CONCURRENCY)).split(",")]
    for c in levels:
        level(a, c, len(levels) > 1)
    return 0


def level(a, concurrency: int, several: bool) -> None:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    work = jobs(a.tokens)
    rounds = len(ORDERS) * max(1, a.rounds)
    with contextlib.ExitStack() as kept:
        inproc = InProcess(path, threads, concurrency)
        kept.callback(inproc.close)
        sides = {"in-process": inproc.run}
        for name, depth in (("node", 2), ("lockstep", 1)):
            node = kept.enter_context(NodeProcess(path, *node_args(threads, concurrency, depth)))
            c = kept.enter_context(node.client(timeout_s=600))
            warm(c)
            sides[name] = lambda w, c=c: on_node(c, w)
        for run in sides.values():  # a round not counted: each side's cost model and pipeline as a serving node's
            run(salted(work, 0))
        runs: dict[str, list[dict]] = {k: [] for k in sides}
        for r in range(1, rounds + 1):
            for k in ORDERS[(r - 1) % len(ORDERS)]:
                runs[k].append(sides[k](salted(work, r)))
    ips, nds, lss = runs["in-process"], runs["node"], runs["lockstep"]
    print(f"model {os.path.basename(path)}  {N_JOBS} jobs, prompts 4-100, {a.tokens} new tokens, "
          f"concurrency {concurrency}, threads {threads}, {rounds} rounds on sides kept across them; {llama_build()}")
    print("tok/s: in-process, node (pipelined, the default), node in lockstep (--pipeline-depth 1).")
    print("engine wait = the engine's time between two steps, from one result being ready to the next step "
          "starting, measured in the engine: the front + IPC cost per tick. Its mean is the round's own; its p50 "
          f"and p90 are the node's telemetry's, over its last {WAIT_WINDOW} ticks as the round ends (the kept node's "
          "earlier rounds too).")
    print(f"{'run':>4}{'in-proc':>9}{'node':>8}{'lockstep':>10}{'ratio':>7}{'lockstep':>10}"
          f"{'wait p50 us':>13}{'p90':>6}{'mean':>6}{'lockstep p50':>14}{'non-engine us/tick ip/node/lock':>33}")
    figures = []
    for i, (ip, nd, ls) in enumerate(zip(ips, nds, lss), 1):
        f = {"in_process_tok_s": ip["gen_tok_s"], "node_tok_s": nd["gen_tok_s"], "lockstep_tok_s": ls["gen_tok_s"],
             "ratio": nd["gen_tok_s"] / ip["gen_tok_s"], "ratio_lockstep": ls["gen_tok_s"] / ip["gen_tok_s"],
             "ticks_in_process": ip["ticks"], "ticks_node": nd["ticks"], "ticks_lockstep": ls["ticks"],
             "engine_wait_us_p50": nd["wait_us_p50"], "engine_wait_us_p90": nd["wait_us_p90"],
             "engine_wait_us_mean": nd["wait_us_mean"], "lockstep_wait_us_p50": ls["wait_us_p50"],
             "lockstep_wait_us_mean": ls["wait_us_mean"],
             "non_engine_us_per_tick_in_process": _non_engine_us(ip), "non_engine_us_per_tick_node": _non_engine_us(nd),
             "non_engine_us_per_tick_lockstep": _non_engine_us(ls),
             "same_tokens": ip["tokens"] == nd["tokens"], "same_tokens_lockstep": ip["tokens"] == ls["tokens"]}
        figures.append(f)
        print(f"{i:>4}{f['in_process_tok_s']:9.1f}{f['node_tok_s']:8.1f}{f['lockstep_tok_s']:10.1f}{f['ratio']:7.3f}"
              f"{f['ratio_lockstep']:10.3f}{f['engine_wait_us_p50']:13.0f}{f['engine_wait_us_p90']:6.0f}"
              f"{f['engine_wait_us_mean']:6.0f}{f['lockstep_wait_us_p50']:14.0f}"
              f"{f['non_engine_us_per_tick_in_process']:15.0f}/{f['non_engine_us_per_tick_node']:.0f}"
              f"/{f['non_engine_us_per_tick_lockstep']:.0f}")
    ratio, ratio_ls = _ratio_all(nds, ips), _ratio_all(lss, ips)
    median, median_ls = (statistics.median(f[k] for f in figures) for k in ("ratio", "ratio_lockstep"))
    wait = sorted(f["engine_wait_us_p50"] for f in figures)[len(figures) // 2]
    wait_ls = sorted(f["lockstep_wait_us_p50"] for f in figures)[len(figures) // 2]
    print(f"tokens identical to in-process: node {[f['same_tokens'] for f in figures]}, lockstep "
          f"{[f['same_tokens_lockstep'] for f in figures]} (in deterministic mode they must be; without it ticks "
          f"compose differently when submits arrive over the wire, and llama.cpp is not batch-invariant)")
    print(f"lockstep node: node/in-process {ratio_ls:.3f} (median of the rounds {median_ls:.3f}), engine wait p50 "
          f"{wait_ls:.0f} us")
    print(f"all {len(figures)} rounds: node/in-process {ratio:.3f}, median of the rounds {median:.3f} (target >= 0.97: {'met' if ratio >= 0.97 else 'NOT met'}); "
          f"front + IPC per tick, median of the runs' p50 {wait:.0f} us "
          f"(target < 150 us: {'met' if wait < 150 else 'NOT met'})")
    if a.json:
        name = a.json.replace(".json", f"-c{concurrency}.json") if several else a.json
        with open(name, "w") as fh:
            json.dump({"model": path, "llama_build": llama_build(), "concurrency": concurrency, "runs": figures,
                       "ratio_all_runs": ratio, "ratio_all_runs_lockstep": ratio_ls, "ratio_median": median,
                       "ratio_median_lockstep": median_ls, "sides_kept": True, "engine_wait_us_median": wait,
                       "lockstep_wait_us_median": wait_ls}, fh, indent=2)
