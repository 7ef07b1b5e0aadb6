"""A session moved to another node with its KV vs prefilled again there, by context length.

Two nodes on one machine, the same model and recipe. For each context length a
session is started on node A with a prompt of that many tokens, generates a few,
and is exported; its state goes to node B with its KV (`kv` moved) and, for a
second session of another prompt of the same length, without it (B prefills
prompt and generated tokens again). Timed per side: the export on A (the request
to the last KV byte in the client's hands), and on B the import (the request to
the first token B streams). Each round uses new prompts, so no prefix cache
helps either side. Prompts are seeded token ids (a move's cost is its bytes and
a prefill's its positions: neither depends on what the tokens say).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time

from meshnode.bench import llama_build, model_path
from meshnode.dev.hostile import mesh_key
from meshnode.dev.nodeproc import NodeProcess

LENGTHS = (1024, 2048, 4096, 8000)
SLOTS, CTX_SEQ = 2, 8448  # streams: every session of up to 8,000 + its new tokens fits its own stream


def _prompt(n: int, salt: int) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _leave(ca, sid: str, n: int, salt: int) -> tuple[dict, float]:
    """A session of an n-token prompt started on A, exported once it generates: its state and the export's time."""
    ca.submit(sid, tokens=_prompt(n, salt), max_tokens=64, ignore_eos=True)
    for _ in range(4):
        ca.wait_for(lambda e: e["event"] == "tokens" and e["id"] == sid)
    t0 = time.perf_counter()
    state = ca.export(sid, timeout_s=600)
    export_s = time.perf_counter() - t0
    ca.collect([sid], timeout_s=600)
    return state, export_s


def _arrive(cb, sid: str, state: dict) -> float:
    """The import on B: the request to its first token there."""
    t0 = time.perf_counter()
    cb.resume(sid, state)
    cb.wait_for(lambda e: e["event"] == "tokens" and e["id"] == sid, timeout_s=600)
    first = time.perf_counter() - t0
    cb.cancel(sid)
    cb.collect([sid], timeout_s=600)
    return first


def main(a) -> int:
    path = model_path(a)
    print(f"bench moves: {os.path.basename(path)}, threads {a.threads or 'all'}, {a.rounds} rounds; {llama_build()}")
    args = ("--threads", str(a.threads), "--n-seq-max", str(SLOTS), "--ctx", str(SLOTS * CTX_SEQ),
            "--log-level", "WARNING", "--mesh-key-file", mesh_key(tempfile.mkdtemp()))  # one mesh: KV is loaded
    rows = {}
    with NodeProcess(path, *args) as na, NodeProcess(path, *args) as nb, na.client(600) as ca, nb.client(600) as cb:
        for n in LENGTHS:
            runs = []
            for r in range(a.rounds):
                state, export_s = _leave(ca, f"kv-{n}-{r}", n, salt=2 * (n + r))
                kv_bytes, positions = state["kv"]["bytes"], state["kv"]["positions"]
                moved_s = _arrive(cb, f"kv-{n}-{r}", state)
                plain, _ = _leave(ca, f"pf-{n}-{r}", n, salt=2 * (n + r) + 1)
                del plain["kv"]
                prefill_s = _arrive(cb, f"pf-{n}-{r}", plain)
                runs.append(dict(export_s=export_s, import_kv_s=moved_s, import_prefill_s=prefill_s,
                                 kv_bytes=kv_bytes, positions=positions))
                print(f"  {n:5} tokens round {r + 1}: export {export_s * 1e3:7.1f} ms ({kv_bytes / 2**20:6.1f} MiB, "
                      f"{positions} positions); first token on B: with KV {moved_s * 1e3:7.1f} ms, "
                      f"prefilled again {prefill_s * 1e3:8.1f} ms")
            med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
            rows[n] = {"rounds": runs, "median": med}
    print("medians; 'move' = export on A + import on B with the KV, 're-prefill' = the import on B without it "
          "(the export is needed either way)")
    print(f"{'context':>8} {'KV MiB':>8} {'export ms':>10} {'import+KV ms':>13} {'move ms':>9} {'re-prefill ms':>14} "
          f"{'re-prefill / move':>18}")
    for n, row in rows.items():
        m = row["median"]
        move = m["export_s"] + m["import_kv_s"]
        print(f"{n:>8} {m['kv_bytes'] / 2**20:>8.1f} {m['export_s'] * 1e3:>10.1f} {m['import_kv_s'] * 1e3:>13.1f} "
              f"{move * 1e3:>9.1f} {m['import_prefill_s'] * 1e3:>14.1f} {m['import_prefill_s'] / move:>17.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "build": llama_build(), "threads": a.threads, "rounds": a.rounds,
                       "lengths": rows}, f, indent=2)
    return 0
