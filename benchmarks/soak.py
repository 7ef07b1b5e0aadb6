"""`python -m benchmarks soak`: mixed load, random cancels, an engine kill every few seconds.

Keeps about 12 sessions in flight from 3 clients (mixed prompt lengths, greedy
and seeded, some with stop tokens), cancels some at random, SIGKILLs the
engine every --kill-every seconds, and at the end waits for every admitted
session's `done`. Lost = admitted sessions that never got one: must be 0.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time

from meshnode.bench import model_path
from meshnode.client import Client
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess

IN_FLIGHT_PER_CLIENT = 4


def main(a) -> int:
    path = model_path(a)
    rng = random.Random(7)
    args = ["--max-active", "8", "--max-queue", "16", "--threads", str(a.threads), "--log-level", "WARNING"]
    counts = {"submitted": 0, "admitted": 0, "rejected": 0, "completed": 0, "cancelled": 0, "kills": 0}
    by_reason: dict[str, int] = {}
    rss = []
    with NodeProcess(path, *args) as node:
        clients = [Client(node.listen, timeout_s=120) for _ in range(3)]
        open_: list[set] = [set() for _ in clients]
        admitted_ids: set = set()
        done_ids: set = set()
        t0 = time.monotonic()
        end = t0 + a.minutes * 60
        next_kill, next_sample, n = t0 + a.kill_every, t0, 0
        status = clients[0]
        while time.monotonic() < end:
            for k, c in enumerate(clients):
                while len(open_[k]) < IN_FLIGHT_PER_CLIENT:
                    n += 1
                    sid = f"s{n}"
                    sampling = Sampling(0.8, 40, 0.95, n) if n % 3 == 0 else None
                    c.submit(sid, tokens=[3 + (n * 7 + i) % 500 for i in range(rng.choice([1, 8, 40, 200]))],
                             max_tokens=rng.choice([4, 16, 64]), sampling=sampling,
                             stop_tokens=[rng.randrange(3, 512)] if n % 5 == 0 else None)
                    open_[k].add(sid)
                    counts["submitted"] += 1
                if open_[k] and rng.random() < 0.05:
                    c.cancel(rng.choice(sorted(open_[k])))
                _drain(c, k, open_, admitted_ids, done_ids, counts, by_reason, 0.01)
            now = time.monotonic()
            if now >= next_kill:
                pid = status.status()["node"]["engine_pid"]
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    counts["kills"] += 1
                next_kill = now + a.kill_every
            if now >= next_sample:
                t = status.status()["telemetry"]
                rss.append((round(now - t0, 1), t["front_rss_bytes"], t["engine"]["rss_bytes"]))
                next_sample = now + max(5.0, a.minutes * 6)
        settle = time.monotonic() + 120
        while any(open_) and time.monotonic() < settle:
            for k, c in enumerate(clients):
                _drain(c, k, open_, admitted_ids, done_ids, counts, by_reason, 0.05)
        t = status.status()["telemetry"]
        for c in clients:
            c.close()
    lost = len(admitted_ids - done_ids)
    print(f"soak {a.minutes:g} min on {os.path.basename(path)}, engine killed every {a.kill_every:g} s "
          f"({counts['kills']} kills, {t['engine']['restarts']} restarts)")
    print(f"sessions submitted {counts['submitted']}  completed {counts['completed']}  rejected {counts['rejected']}"
          f"  lost {lost}")
    print("done reasons: " + ", ".join(f"{r} {k}" for r, k in sorted(by_reason.items())))
    print(f"{'t (s)':>8}{'front RSS MiB':>15}{'engine RSS MiB':>16}")
    for ts, f, e in rss:
        print(f"{ts:8.1f}{f / 2**20:15.1f}{e / 2**20:16.1f}")
    print(f"KV reserved at the end: {t['kv_bytes']} bytes; lost must be 0: {'OK' if lost == 0 else 'FAILED'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"minutes": a.minutes, "kill_every_s": a.kill_every, **counts, "lost": lost,
                       "done_reasons": by_reason, "rss": rss, "restarts": t["engine"]["restarts"]}, f, indent=2)
    return 0 if lost == 0 else 1


def _drain(c, k, open_, admitted_ids, done_ids, counts, by_reason, wait_s) -> None:
    ev = c.recv(wait_s)
    while ev is not None:
        sid, kind = ev.get("id"), ev["event"]
        if kind == "admitted":
            admitted_ids.add(sid)
            counts["admitted"] += 1
        elif kind == "rejected":
            counts["rejected"] += 1
            open_[k].discard(sid)
        elif kind == "done":
            done_ids.add(sid)
            counts["completed"] += 1
            by_reason[ev["reason"]] = by_reason.get(ev["reason"], 0) + 1
            open_[k].discard(sid)
        ev = c.recv(0)
