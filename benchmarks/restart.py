"""What an engine death costs a live session: the wait, and whether its continuation is the same.

1. Latency: one long greedy session decodes; the engine is killed three times;
   each time the wait until a token arrives from the restarted (and
   re-prefilled) engine is printed: backoff + spawn + model load + re-prefill.
2. Continuation: three long sessions (two greedy, one seeded) run once without a
   fault and once with the engine killed at the first session's token 300; for
   each, the first token where the two runs differ (or "identical"). In the
   default mode the restored context is recomputed in other batches than the
   first time, and llama.cpp's numerics depend on the batch.
"""
from __future__ import annotations

import json
import os
import signal
import time

from meshnode.bench import model_path
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess

KILL_AT = 300


def latency(path: str, threads: int) -> list[float]:
    waits = []
    with NodeProcess(path, "--threads", str(threads), "--log-level", "WARNING") as n, n.client() as c:
        c.submit("a", tokens=[3, 4, 5], max_tokens=3000, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "tokens")
        for _ in range(3):
            st = c.status()
            pid, restarts = st["node"]["engine_pid"], st["telemetry"]["engine"]["restarts"]
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            while c.status()["telemetry"]["engine"]["restarts"] == restarts:
                time.sleep(0.005)
            # the front sends in order: every token of the old engine came before that status reply
            c.buffer = type(c.buffer)(e for e in c.buffer if e["event"] != "tokens")
            c.wait_for(lambda e: e["event"] == "tokens")
            waits.append(time.monotonic() - t0)
            time.sleep(0.5)
        c.cancel("a")
    return waits


def _jobs(n: int) -> dict:
    return {"greedy-1": dict(tokens=[3, 4, 5], max_tokens=n, ignore_eos=True),
            "greedy-2": dict(tokens=[7 + k for k in range(40)], max_tokens=n, ignore_eos=True),
            "seeded": dict(tokens=[9, 8, 7], max_tokens=n, ignore_eos=True, sampling=Sampling(0.8, 40, 0.95, 11))}


def _run(path: str, threads: int, jobs: dict, kill: bool, extra: list[str]) -> dict[str, list[int]]:
    # default ctx: every session may reach 4,096 tokens (a fixed --ctx 8192 left 1,024 a stream: all refused)
    with NodeProcess(path, "--threads", str(threads), "--log-level", "WARNING", *extra) as n, \
            n.client(timeout_s=1800) as c:
        for sid, kw in jobs.items():
            c.submit(sid, **kw)
        if kill:
            seen, kept = 0, []
            while seen < KILL_AT:
                ev = c.recv(120)
                if ev is None or ev["event"] in ("rejected", "error"):
                    raise RuntimeError(f"no tokens to kill the engine under: {ev or 'nothing in 120 s'}")
                kept.append(ev)
                seen += ev["event"] == "tokens" and ev["id"] == "greedy-1"
            os.kill(c.status()["node"]["engine_pid"], signal.SIGKILL)
            c.buffer.extendleft(reversed(kept))
        return {sid: r.tokens for sid, r in c.collect(list(jobs), timeout_s=1800).items()}


def continuation(path: str, threads: int, n: int, extra: list[str]) -> dict[str, int | None]:
    """Per session, the first token index where the faulted run differs (None: identical)."""
    jobs = _jobs(n)
    ref, got = _run(path, threads, jobs, False, extra), _run(path, threads, jobs, True, extra)
    return {sid: next((i for i, (a, b) in enumerate(zip(ref[sid], got[sid])) if a != b),
                      None if ref[sid] == got[sid] else min(len(ref[sid]), len(got[sid]))) for sid in jobs}


def main(a) -> int:
    path = model_path(a)
    waits = latency(path, a.threads)
    print(f"model {os.path.basename(path)}: SIGKILL -> first token from the restarted engine: "
          + ", ".join(f"{w:.2f} s" for w in waits))
    n = max(a.tokens, 1500)
    diverged = continuation(path, a.threads, n, [])
    print(f"continuation of {n}-token sessions, engine killed at token {KILL_AT}, vs the same run without a fault:")
    for sid, at in diverged.items():
        print(f"  {sid:10} {'identical' if at is None else f'first differs at token {at}'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "waits_s": waits, "continuation_tokens": n, "kill_at": KILL_AT,
                       "first_difference": diverged}, f, indent=2)
    return 0
