"""How long an engine death costs a live session: SIGKILL to the first token of the new engine.

One long greedy session decodes; the engine is killed three times; each time
the wait until a token arrives from the restarted (and re-prefilled) engine is
printed. That wait is backoff + spawn + model load + re-prefill.
"""
from __future__ import annotations

import json
import os
import signal
import time

from meshnode.bench import model_path
from meshnode.nodeproc import NodeProcess


def main(a) -> int:
    path = model_path(a)
    waits = []
    with NodeProcess(path, "--threads", str(a.threads), "--log-level", "WARNING") as n, n.client() as c:
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
    print(f"model {os.path.basename(path)}: SIGKILL -> first token from the restarted engine: "
          + ", ".join(f"{w:.2f} s" for w in waits))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "waits_s": waits}, f, indent=2)
    return 0
