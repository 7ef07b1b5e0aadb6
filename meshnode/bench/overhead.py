"""What the process split costs: the full node vs the engine in-process, same scheduler.

The same 16 jobs (prompts 4 to 100 tokens, 32 new tokens, concurrency 8) run
through a real node (front + engine processes, ZeroMQ, msgpack, shared memory)
and through Scheduler + LlamaEngine in this process. Runs alternate, three
times each, so drift on a shared machine hits both sides alike, and the
verdict uses all runs together (total tokens over total time), not the best.
"""
from __future__ import annotations

import json
import os
import time

from meshnode.bench import model_path
from meshnode.budget import NodeBudget
from meshnode.engine.llama_engine import EngineConfig, LlamaEngine
from meshnode.nodeproc import NodeProcess
from meshnode.scheduler import Scheduler
from meshnode.session import Session

CONCURRENCY, N_JOBS = 8, 16


def jobs(new_tokens: int) -> list[tuple[str, list[int], int]]:
    lens = [4 + (96 * i) // (N_JOBS - 1) for i in range(N_JOBS)]  # 4 .. 100
    return [(f"j{i}", [3 + (i * 53 + k * 11) % 509 for k in range(n)], new_tokens) for i, n in enumerate(lens)]


class _Timed:
    """The engine, adding up its own step time so wall time splits into engine and the rest."""

    def __init__(self, engine: LlamaEngine):
        self.engine, self.step_ms = engine, 0.0

    def step(self, plan):
        res = self.engine.step(plan)
        self.step_ms += res.step_ms
        return res


def in_process(path: str, threads: int, work) -> dict:
    engine = LlamaEngine(EngineConfig(path, n_seq_max=8, n_ctx=4096, n_threads=threads))
    sched = Scheduler(NodeBudget.from_engine(engine, max_active=CONCURRENCY, max_queue=N_JOBS), engine.eog)
    timed = _Timed(engine)
    t0 = time.perf_counter()
    for sid, toks, n in work:
        sched.submit(Session(sid, toks, n, ignore_eos=True))
    events = sched.run_to_completion(timed)
    wall = time.perf_counter() - t0
    engine.close()
    out = {e.session.key: e.tokens for e in events if e.kind == "done"}
    return {"wall_s": wall, "ticks": sched.counters.ticks, "tokens": out, "step_ms": timed.step_ms,
            "gen_tok_s": sum(map(len, out.values())) / wall}


def through_node(path: str, threads: int, work) -> dict:
    args = ["--max-active", str(CONCURRENCY), "--max-queue", str(N_JOBS), "--threads", str(threads),
            "--ctx", "4096", "--log-level", "WARNING"]
    with NodeProcess(path, *args) as node, node.client(timeout_s=600) as c:
        c.generate("warm", tokens=[3, 4, 5], max_tokens=2)  # page weights in, like the in-process engine
        t = c.status()["telemetry"]
        ticks0, step0 = t["ticks_total"], t["engine"]["step_ms_total"]
        gap0, gaps0 = t["engine"]["busy_gap_ms_total"], t["engine"]["busy_gaps"]
        t0 = time.perf_counter()
        for sid, toks, n in work:
            c.submit(sid, tokens=toks, max_tokens=n, ignore_eos=True)
        res = c.collect([w[0] for w in work], timeout_s=600)
        wall = time.perf_counter() - t0
        t = c.status()["telemetry"]
        ticks, step_ms = t["ticks_total"] - ticks0, t["engine"]["step_ms_total"] - step0
        gap_us = (t["engine"]["busy_gap_ms_total"] - gap0) / max(1, t["engine"]["busy_gaps"] - gaps0) * 1e3
    out = {sid: r.tokens for sid, r in res.items()}
    return {"wall_s": wall, "ticks": ticks, "tokens": out, "step_ms": step_ms, "gap_us": gap_us, "gen_tok_s": sum(map(len, out.values())) / wall}


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    work = jobs(a.tokens)
    runs = []
    for _ in range(3):
        runs.append((in_process(path, threads, work), through_node(path, threads, work)))
    print(f"model {os.path.basename(path)}  {N_JOBS} jobs, prompts 4-100, {a.tokens} new tokens, "
          f"concurrency {CONCURRENCY}, threads {threads}")
    print(f"{'run':>4}{'in-proc tok/s':>15}{'node tok/s':>12}{'ratio':>8}{'ticks':>7}"
          f"{'non-engine us/tick in-proc':>28}{'node':>8}{'front+IPC us/tick':>19}")
    figures = []
    for i, (ip, nd) in enumerate(runs, 1):
        ratio = nd["gen_tok_s"] / ip["gen_tok_s"]
        # time per tick outside llama_decode + sampling: scheduler only in-process; scheduler, front and IPC in the node
        gap_ip = (ip["wall_s"] * 1e3 - ip["step_ms"]) / ip["ticks"] * 1e3
        gap_nd = (nd["wall_s"] * 1e3 - nd["step_ms"]) / nd["ticks"] * 1e3
        figures.append({"in_process_tok_s": ip["gen_tok_s"], "node_tok_s": nd["gen_tok_s"], "ratio": ratio,
                        "ticks_in_process": ip["ticks"], "ticks_node": nd["ticks"],
                        "non_engine_us_per_tick_in_process": gap_ip, "non_engine_us_per_tick_node": gap_nd,
                        "overhead_us_per_tick": gap_nd - gap_ip,
                        "engine_wait_us_per_tick": nd["gap_us"],
                        "engine_ms_per_tick_in_process": ip["step_ms"] / ip["ticks"],
                        "engine_ms_per_tick_node": nd["step_ms"] / nd["ticks"],
                        "same_tokens": ip["tokens"] == nd["tokens"]})
        print(f"{i:>4}{ip['gen_tok_s']:15.1f}{nd['gen_tok_s']:12.1f}{ratio:8.3f}{nd['ticks']:7d}"
              f"{gap_ip:28.0f}{gap_nd:8.0f}{gap_nd - gap_ip:19.0f}")
    ratio = sum(nd["gen_tok_s"] * nd["wall_s"] for _, nd in runs) / sum(nd["wall_s"] for _, nd in runs) / (
        sum(ip["gen_tok_s"] * ip["wall_s"] for ip, _ in runs) / sum(ip["wall_s"] for ip, _ in runs))
    wait = sorted(f["engine_wait_us_per_tick"] for f in figures)[len(figures) // 2]
    print(f"engine ms/tick in-process {sum(f['engine_ms_per_tick_in_process'] for f in figures) / len(figures):.1f}, "
          f"in the node {sum(f['engine_ms_per_tick_node'] for f in figures) / len(figures):.1f}")
    print("engine's own wait between its reply and the next tick (front + IPC, measured in the engine): "
          + ", ".join(f"{f['engine_wait_us_per_tick']:.0f} us" for f in figures))
    print(f"tokens identical node vs in-process: {[f['same_tokens'] for f in figures]} "
          f"(llama.cpp is not batch-invariant; ticks compose differently when submits arrive over the wire)")
    print(f"all runs: node/in-process {ratio:.3f} (target >= 0.97: {'met' if ratio >= 0.97 else 'NOT met'}); "
          f"front + IPC per tick, median {wait:.0f} us (target < 150 us: {'met' if wait < 150 else 'NOT met'})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "runs": figures, "ratio_all_runs": ratio,
                       "engine_wait_us_median": wait}, f, indent=2)
    return 0
