"""`python -m benchmarks priority`: two priorities under overload, `--scheduling-policy priority` vs fcfs.

A node with 3 slots and a queue of 8. The low class keeps it overloaded: its requests are sent as fast as
the node takes them (a refused one is sent again 50 ms later), 48 new tokens each. A high-class request
(priority -1, 8 new tokens) arrives every `HIGH_EVERY_S`. Measured per side: the high class's first-token
time (from its submit to its first token, as the client sees it), the low class's, how many low requests
were refused or displaced; and, before the load, the high class's first-token time on the idle node (one
at a time). Sides in an order that rotates each round: `priority` (the high class sends priority -1),
`reserved` (the same with `--priority-reserved-slots 1`: the low class runs on 2 slots, the third is kept
for a better request) and `fcfs` (the same load; priority cannot be sent there, so the high class waits
in arrival order, and a high request the full queue refuses is sent again 10 ms later, ahead of the low
class's refill, its time counted from its first send). The goal (issue 47): the high class's median
first-token time under overload within 1.2x of the idle node's. Under the priority policy a high request
that finds every slot busy preempts a low session (counted per side); under fcfs it waits.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from meshnode.bench import llama_build, model_path
from meshnode.core import reasons as R
from meshnode.dev.nodeproc import NodeProcess

SLOTS, QUEUE, LOW_TOKENS, HIGH_TOKENS, HIGH_EVERY_S, HIGHS, IDLE_HIGHS = 3, 8, 48, 8, 1.5, 12, 6
SIDES = {"priority": ["--scheduling-policy", "priority"],
         "reserved": ["--scheduling-policy", "priority", "--priority-reserved-slots", "1"],
         "fcfs": ["--scheduling-policy", "fcfs"]}


def _prompt(i: int, n: int = 24) -> list[int]:
    return [3 + (i * 131 + k * 17) % 1000 for k in range(n)]


def _idle(c) -> list[float]:
    """The high class alone: first-token ms of each, one at a time."""
    out = []
    for i in range(IDLE_HIGHS):
        t0 = time.monotonic()
        r = c.generate(f"idle{i}", tokens=_prompt(10_000 + i), max_tokens=HIGH_TOKENS, ignore_eos=True)
        out.append((r.token_times[0] - t0) * 1e3)
    return out


def _overload(c, priority: bool, tag: str) -> dict:
    """Low requests kept at the node's limit, a high one every HIGH_EVERY_S: first-token ms per class."""
    sent, first, kind, retry = {}, {}, {}, {}
    refused = displaced = high_refused = 0
    low_live, n_low, highs, low_after = 0, 0, 0, 0.0
    next_high = time.monotonic() + HIGH_EVERY_S
    while highs < HIGHS or retry or any(kind[s] == "high" and s not in first for s in sent):
        now = time.monotonic()
        if highs < HIGHS and now >= next_high:
            sid = f"{tag}-high{highs}"
            highs += 1
            next_high += HIGH_EVERY_S
            sent[sid], kind[sid], retry[sid] = time.monotonic(), "high", now
        for sid, at in list(retry.items()):  # a refused high request is sent again (its time counts from the first)
            if now >= at:
                del retry[sid]
                c.submit(sid, tokens=_prompt(5000 + int(sid.rsplit("high", 1)[1])), max_tokens=HIGH_TOKENS,
                         ignore_eos=True, priority=-1 if priority else 0)
        while low_live < SLOTS + QUEUE and highs < HIGHS and not retry and now >= low_after:  # highs go first
            sid = f"{tag}-low{n_low}"
            n_low += 1
            sent[sid], kind[sid] = time.monotonic(), "low"
            c.submit(sid, tokens=_prompt(n_low), max_tokens=LOW_TOKENS, ignore_eos=True)
            low_live += 1
        ev = c.recv(timeout_s=0.05)
        if ev is None:
            continue
        sid = ev.get("id")
        if ev["event"] == "tokens" and sid not in first:
            first[sid] = time.monotonic()
        elif ev["event"] == "rejected" and kind[sid] == "high":
            high_refused += 1
            retry[sid] = time.monotonic() + 0.01
        elif ev["event"] == "rejected":  # the queue is full (of high requests too): the low class backs off
            refused += 1
            low_live -= 1
            low_after = time.monotonic() + 0.05
        elif ev["event"] == "done":
            displaced += ev["reason"] == R.REJECTED_QUEUE_FULL
            low_live -= kind[sid] == "low"
    for sid in [s for s in sent if kind[s] == "low"]:
        c.cancel(sid)
    ms = lambda k: [(first[s] - sent[s]) * 1e3 for s in sent if kind[s] == k and s in first]  # noqa: E731
    return {"high_ttft_ms": ms("high"), "low_ttft_ms": ms("low"), "low_refused": refused, "low_displaced": displaced,
            "high_refused": high_refused}


def _side(path: str, threads: int, side: str, r: int) -> dict:
    with NodeProcess(path, "--threads", str(threads), "--max-active", str(SLOTS), "--max-queue", str(QUEUE),
                     *SIDES[side], "--log-level", "WARNING") as node, node.client(timeout_s=600) as c:
        idle = _idle(c)
        load = _overload(c, side != "fcfs", f"r{r}")
        preempted = c.status()["telemetry"]["preemptions_total"]
        time.sleep(0.5)  # the cancelled lows' dones
        while c.recv(timeout_s=0.2) is not None:
            pass
    return {"idle_high_ttft_ms": idle, **load, "preemptions": preempted}


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    print(f"bench priority: {os.path.basename(path)}, threads {threads}, {a.rounds} rounds; {llama_build()}",
          flush=True)
    runs: dict[str, list[dict]] = {}
    sides = list(SIDES)
    for r in range(a.rounds):
        for policy in sides[r % len(sides):] + sides[:r % len(sides)]:
            f = _side(path, threads, policy, r)
            runs.setdefault(policy, []).append(f)
            med = lambda k: float(np.median(f[k])) if f[k] else float("nan")  # noqa: E731
            print(f"  round {r + 1} {policy:<8} high first token p50 {med('high_ttft_ms'):8.1f} ms "
                  f"(idle {med('idle_high_ttft_ms'):6.1f}), low p50 {med('low_ttft_ms'):8.1f} ms, low refused "
                  f"{f['low_refused']}, displaced {f['low_displaced']}, high refused {f['high_refused']}, preempted "
                  f"{f['preemptions']}", flush=True)
    verdict = []
    for policy, fs in runs.items():
        high = float(np.median([x for f in fs for x in f["high_ttft_ms"]]))
        idle = float(np.median([x for f in fs for x in f["idle_high_ttft_ms"]]))
        low = float(np.median([x for f in fs for x in f["low_ttft_ms"]]))
        p90 = float(np.percentile([x for f in fs for x in f["high_ttft_ms"]], 90))
        verdict.append(f"{policy}: high class first token p50 {high:.1f} ms (p90 {p90:.1f}) vs idle {idle:.1f} ms: "
                       f"{high / idle:.2f}x (goal <= 1.2x: {'met' if high / idle <= 1.2 else 'NOT met'}); low class "
                       f"p50 {low:.1f} ms")
    for line in verdict:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"build": llama_build(), "model": os.path.basename(path), "slots": SLOTS, "queue": QUEUE,
                       "low_tokens": LOW_TOKENS, "high_tokens": HIGH_TOKENS, "high_every_s": HIGH_EVERY_S,
                       "runs": runs, "verdict": verdict}, f, indent=1)
    return 0
