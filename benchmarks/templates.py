"""`python -m benchmarks templates`: a model file's hostile chat templates against a node beside other clients.

The node serves a generated model (`bench-32k`, random weights; a real model's template cannot be swapped
without rewriting its file) whose template is ChatML for everyone but does one of meshnode/dev/hostile.py's
TEMPLATES where a chat's first message names it. Each round has a steady phase (a victim streams, a pinger
pings every 20 ms, an honest chatter asks one-token chats) and an attack phase of the same length, where an
attacker sends every hostile shape in turn, each answered before the next. Printed per round and phase: the
pings' round trip, the victim's gaps between tokens, the honest chats' first token. Goal (issue 66): pings
answered within 100 ms throughout, the victim's worst gap under 0.5 s, every hostile chat refused naming the
template, the node alive.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import Counter

import numpy as np

from meshnode.bench import llama_build
from meshnode.engine.llamacpp import system_info
from meshnode.dev.hostile import TEMPLATES, branching_template
from meshnode.dev.nodeproc import NodeProcess
from meshnode.ops.models import make_model

PING_EVERY_S = 0.02
VICTIM = dict(text="the mesh node serves many clients at once", ignore_eos=True, max_tokens=64)


def _pinger(node, stop, out):
    with node.client(timeout_s=120) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            ok = c.ping(30.0)
            out.append((t0, (time.monotonic() - t0) * 1e3 if ok else float("inf")))
            stop.wait(PING_EVERY_S)


def _victim(node, stop, out):
    with node.client(timeout_s=120) as c:
        k = 0
        while not stop.is_set():
            r = c.generate(f"v{k}", **VICTIM)
            times = sorted(set(r.token_times))  # one event may carry several tokens: gaps between events
            out += [(a, (b - a) * 1e3) for a, b in zip(times, times[1:])]
            k += 1


def _chatter(node, stop, out):
    with node.client(timeout_s=120) as c:
        k = 0
        while not stop.is_set():
            t0 = time.monotonic()
            r = c.generate(f"c{k}", messages=[{"role": "user", "content": f"hello {k}"}], max_tokens=1,
                           ignore_eos=True)
            if r.token_times:
                out.append((t0, (r.token_times[0] - t0) * 1e3))
            k += 1
            stop.wait(0.1)


def _within(rows, lo, hi):
    return [v for t, v in rows if lo <= t < hi]


def _q(values, f):
    return float(f(values)) if values else float("nan")


def main(a) -> int:
    rounds, threads = max(a.rounds, 1), a.threads or 2
    tmp = tempfile.mkdtemp(prefix="meshnode-templates-")
    model = str(make_model(os.path.join(tmp, "hostile.gguf"), "bench-32k", 0, chat_template=branching_template()))
    print(f"bench templates: generated bench-32k with a branching hostile template, {len(TEMPLATES)} shapes, "
          f"{rounds} rounds, threads {threads}; {llama_build()}\n{system_info()}")
    pings, gaps, chats, outcomes, phases = [], [], [], Counter(), []
    stop = threading.Event()
    with NodeProcess(model, "--threads", str(threads), "--max-active", "4", "--log-level", "WARNING") as node, \
            node.client(timeout_s=120) as attacker:
        workers = [threading.Thread(target=f, args=(node, stop, out), daemon=True)
                   for f, out in ((_pinger, pings), (_victim, gaps), (_chatter, chats))]
        for w in workers:
            w.start()
        time.sleep(2.0)  # every side warm
        for r in range(rounds):
            t0 = time.monotonic()
            for i, name in enumerate(TEMPLATES):
                ans = attacker.generate(f"h{r}-{i}", messages=[{"role": "user", "content": name}], max_tokens=2)
                refused = ans.rejected and "chat template" in ans.admission.get("detail", "")
                outcomes["refused naming the template" if refused else f"other: {ans.admission}"] += 1
            t1 = time.monotonic()
            time.sleep(t1 - t0)  # a steady phase as long as the attack
            phases.append((r, t0, t1, time.monotonic()))
        stop.set()
        for w in workers:
            w.join(timeout=120)
        alive = node.proc.poll() is None
    rows = []
    for r, t0, t1, t2 in phases:
        row = {"round": r, "attack_s": t1 - t0}
        for phase, lo, hi in (("attack", t0, t1), ("steady", t1, t2)):
            p, g, c = _within(pings, lo, hi), _within(gaps, lo, hi), _within(chats, lo, hi)
            row |= {f"{phase}_ping_p50_ms": _q(p, np.median), f"{phase}_ping_max_ms": _q(p, max),
                    f"{phase}_gap_p50_ms": _q(g, np.median), f"{phase}_gap_max_ms": _q(g, max),
                    f"{phase}_chat_ttft_p50_ms": _q(c, np.median), f"{phase}_chat_ttft_max_ms": _q(c, max),
                    f"{phase}_pings": len(p)}
        rows.append(row)
    print("\nround  attack s | ping p50/max ms: steady  attack | victim gap p50/max ms: steady  attack | "
          "honest chat ttft p50/max ms: steady  attack")
    for x in rows:
        print(f"{x['round']:5d}  {x['attack_s']:8.1f} | {x['steady_ping_p50_ms']:7.1f}/{x['steady_ping_max_ms']:<6.1f} "
              f"{x['attack_ping_p50_ms']:6.1f}/{x['attack_ping_max_ms']:<6.1f} | "
              f"{x['steady_gap_p50_ms']:6.1f}/{x['steady_gap_max_ms']:<6.1f} "
              f"{x['attack_gap_p50_ms']:6.1f}/{x['attack_gap_max_ms']:<6.1f} | "
              f"{x['steady_chat_ttft_p50_ms']:6.1f}/{x['steady_chat_ttft_max_ms']:<7.1f} "
              f"{x['attack_chat_ttft_p50_ms']:6.1f}/{x['attack_chat_ttft_max_ms']:<7.1f}")
    ping_max = max(x["attack_ping_max_ms"] for x in rows)
    gap_max = max(x["attack_gap_max_ms"] for x in rows)
    for k, v in sorted(outcomes.items()):
        print(f"hostile chat -> {k}: {v}")
    ok = ping_max <= 100 and gap_max < 500 and set(outcomes) == {"refused naming the template"} and alive
    print(f"\nworst ping under attack {ping_max:.1f} ms (goal <= 100), victim's worst gap under attack "
          f"{gap_max:.1f} ms "
          f"(goal < 500), node alive {alive}: goal {'met' if ok else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": "generated bench-32k (random weights), branching hostile template",
                       "build": llama_build(), "system_info": system_info(), "shapes": list(TEMPLATES),
                       "rows": rows, "outcomes": dict(outcomes), "alive": alive, "goal_met": ok}, f, indent=1)
    return 0 if ok else 1
