"""`python -m benchmarks toolflood`: 50 `tool_choice: "required"` calls at once through the gateway beside another
client's ZeroMQ stream (issue 66: they raised its gap p99 from 85 ms to 1.17 s).

One node (real model by default, `--http`) serves every round. A victim streams 64-token answers throughout;
each round has a steady phase (the victim alone) and a flood phase (50 calls of the openai SDK at once, one
function, temperature 1, max_tokens 64). Printed per round and phase: the victim's gaps between token events
(p50, p99, max) and the flood's wall and finish reasons. What a flood costs the victim is the tick target's
bound (`tick_target_ratio` decode ticks with prompt rows in them) plus what the gateway's and the front's CPU
takes from the engine's threads on this machine; the node's DEBUG log (`meshnode.front.ticks`) shows each
tick's shape and time.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.embed import up
from benchmarks.templates import _victim, _within
from ipc.transport import free_tcp_port
from meshnode.bench import llama_build, model_path
from meshnode.dev.nodeproc import NodeProcess
from meshnode.dev.toolsets import ASK, WEATHER
from meshnode.engine.llamacpp import system_info

CALLS = 50
STEADY_S = 5.0


def _flood(oa) -> list[str]:
    def call(seed):
        return oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                          temperature=1.0, seed=seed, max_tokens=64).choices[0].finish_reason
    with ThreadPoolExecutor(CALLS) as pool:
        return list(pool.map(call, range(CALLS)))


def _stats(gaps: list[float]) -> dict:
    if not gaps:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    return {"p50": float(np.median(gaps)), "p99": float(np.percentile(gaps, 99)), "max": float(max(gaps)),
            "n": len(gaps)}


def main(a) -> int:
    import openai

    a.model = a.model or "smollm2-q8_0"
    path, rounds, threads = model_path(a), max(a.rounds, 1), a.threads or 2
    print(f"bench toolflood: {path}, {CALLS} required tool calls at once vs a ZeroMQ stream, {rounds} rounds, "
          f"threads {threads}; {llama_build()}", flush=True)
    port, gaps, stop, rows = free_tcp_port(), [], threading.Event(), []
    with NodeProcess(path, "--http", f"127.0.0.1:{port}", "--threads", str(threads), "--log-level", "WARNING") as node:
        up(f"http://127.0.0.1:{port}")
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        victim = threading.Thread(target=_victim, args=(node, stop, gaps), daemon=True)
        victim.start()
        for r in range(rounds):
            t0 = time.monotonic()
            time.sleep(STEADY_S)
            t1 = time.monotonic()
            finishes = _flood(oa)
            t2 = time.monotonic()
            rows.append({"round": r, "steady": _stats(_within(gaps, t0, t1)), "flood": _stats(_within(gaps, t1, t2)),
                         "flood_s": t2 - t1, "finishes": {f: finishes.count(f) for f in set(finishes)}})
            x = rows[-1]
            print(f"round {r}: victim gap p50/p99/max ms steady {x['steady']['p50']:.0f}/{x['steady']['p99']:.0f}/"
                  f"{x['steady']['max']:.0f}, flood {x['flood']['p50']:.0f}/{x['flood']['p99']:.0f}/"
                  f"{x['flood']['max']:.0f}; flood {x['flood_s']:.1f} s, {x['finishes']}", flush=True)
        stop.set()
        victim.join(timeout=120)
    p99 = [x["flood"]["p99"] / x["steady"]["p50"] for x in rows]
    top = [x["flood"]["max"] / x["steady"]["p50"] for x in rows]
    print(f"flood p99 / steady p50: median {np.median(p99):.1f}x (rounds {min(p99):.1f}-{max(p99):.1f}); "
          f"flood max / steady p50: median {np.median(top):.1f}x (rounds {min(top):.1f}-{max(top):.1f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "build": llama_build(), "system_info": system_info(), "rows": rows}, f, indent=1)
    return 0
