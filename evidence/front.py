"""Evidence sections about the front: its cost per tick before and after the tick driver and output stage
(issue 46), and two priorities under overload (issue 47)."""
from __future__ import annotations

import statistics

from sections import load


def overhead_before_after() -> list[str]:
    """`bench overhead` on the real model at the commit before issue 46's restructuring and after it."""
    md = []
    for c in (1, 8):
        before = load(f"overhead-bench-smollm2-before-front-c{c}.json")
        after = load(f"overhead-bench-smollm2-c{c}.json")
        if not (before and after):
            continue
        if not md:
            md = ["## The front's cost per tick, before and after the tick driver and output stage (issue 46)", "",
                  "`meshnode bench overhead --model smollm2-q8_0 --levels 1,8`, SmolLM2-135M-Instruct q8_0 (a real "
                  "model), 16 jobs, 6 rounds each: before = commit 3d902aa (the same command from a worktree of it, "
                  "`PYTHONPATH` set to it; files `overhead-bench-smollm2-before-front-c*.json`), after = commit 7a84cb5 "
                  "(`overhead-bench-smollm2-c*.json`; the commits after it touched the priority policy, a stalled "
                  "client's case in the output stage and docs). Two runs of a noisy shared machine, not side by side: the "
                  "per-tick figures are the ones to compare.", "",
                  "| concurrency | side | node / in-process | engine wait p50 (median of rounds) us | "
                  "front + IPC us per tick, node (median of rounds) | lockstep engine wait p50 us |",
                  "|---|---|---|---|---|---|"]
        for name, o in (("before", before), ("after", after)):
            per_tick = statistics.median(r["non_engine_us_per_tick_node"] for r in o["runs"])
            md.append(f"| {c} | {name} | {o['ratio_all_runs']:.3f} | {o['engine_wait_us_median']:.0f} | "
                      f"{per_tick:.0f} | {o['lockstep_wait_us_median']:.0f} |")
    if md:
        md += ["", f"Builds: before {before.get('llama_build', '?')}; after {after.get('llama_build', '?')}.", ""]
    return md


def priority() -> list[str]:
    p = load("priority-bench-smollm2.json")
    if not p:
        return []
    md = ["## Priorities under overload (issue 47)", "",
          "`python -m benchmarks priority --model smollm2-q8_0 --rounds 2 --json evidence/priority-bench-smollm2.json` "
          f"({p['build']}). SmolLM2-135M-Instruct q8_0, {p['slots']} slots, a queue of {p['queue']}; the low class "
          f"keeps the node overloaded ({p['low_tokens']} new tokens each), a high-class request ({p['high_tokens']} "
          f"new tokens) every {p['high_every_s']} s; first-token times as the client sees them, ms.", "",
          "| policy | round | high p50 | high p90 | idle high p50 | low p50 | low refused | low displaced | "
          "high refused (sent again) | low preempted |", "|---|---|---|---|---|---|---|---|---|---|"]
    q = lambda xs, f: statistics.quantiles(xs, n=10)[8] if f == 90 and len(xs) > 1 else statistics.median(xs)  # noqa
    for policy, runs in p["runs"].items():
        for i, r in enumerate(runs, 1):
            md.append(f"| {policy} | {i} | {q(r['high_ttft_ms'], 50):.0f} | {q(r['high_ttft_ms'], 90):.0f} | "
                      f"{q(r['idle_high_ttft_ms'], 50):.0f} | {q(r['low_ttft_ms'], 50):.0f} | {r['low_refused']} | "
                      f"{r['low_displaced']} | {r['high_refused']} | {r.get('preemptions', 'n/a')} |")
    return md + ["", *[f"- {v}" for v in p["verdict"]], "",
                 "Under `priority` a high request that finds every slot busy preempts the worst low session "
                 "(recompute: it goes back to the queue with its tokens; the `low preempted` column); with a slot "
                 "kept for it (`reserved`) it starts without preempting. Either way what it still waits for is the "
                 "ticks already planned when it arrives (the one the engine runs and the one planned behind it, "
                 "often holding a low request's 24-token prefill, a hundred ms or more on this CPU where a row "
                 "costs about what a decode does) and its own prefill beside the low class's decode rows; an idle "
                 "node has neither. The run before preemption (commit eca92f1, same command): priority 5.71x, "
                 "reserved 1.82x, fcfs 41.67x.", ""]
