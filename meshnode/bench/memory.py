"""`meshnode bench memory`: what a session and a cached conversation cost in memory, and whether KV bytes
budgeted are KV bytes resident (issue 28, 5c-d).

- Sessions: RSS (psutil) of the front and of the engine process at idle after load, beside llama.cpp's own
  buffers (weights and KV, from its load log), then with 1, 8 and 32 sessions decoding (distinct prompts of
  PROMPT tokens): the growth per active session, set beside the KV llama.cpp holds for one sequence.
- KV types (f16, q8_0, q4_0 for K and V): the bytes a token takes as the budget counts them, llama.cpp's KV
  buffer, and the engine's RSS at idle: its difference to f16's beside the buffers' difference says whether
  the bytes the budget counts are the bytes the process holds; and how many 4,096-token sessions fit 4 GiB.
- The prefix cache with 100 conversations: 100 users' first turns through one node (the cache keeps every
  conversation), then their second turns re-sending the history: hit rate and tokens reused, the RSS each
  kept conversation adds, and the cache lookup (PrefixCache.find) timed in this process with 10-250 entries.
"""
from __future__ import annotations

import json
import time

import numpy as np
import psutil

from meshnode.bench import llama_build, model_path
from meshnode.dev.nodeproc import NodeProcess

PROMPT = 256  # tokens of each active session's prompt
ACTIVE = (1, 8, 32)
USERS, SYSTEM, NEW, ANSWER = 100, 200, 48, 24  # the cached-conversation workload
WAVE = 8  # conversations submitted together
MIB = 1 << 20
VOCAB = 256  # prompt token ids below this: every preset and real model has them


def rss(node: NodeProcess) -> dict:
    """Resident bytes of the front and of its engine (the child holding the weights, the largest)."""
    front = psutil.Process(node.proc.pid)
    kids = [p.memory_info().rss for p in front.children(recursive=True)]
    return {"front": front.memory_info().rss, "engine": max(kids) if kids else 0}


def llama_buffers(info: dict) -> dict:
    devices = info["devices"]
    return {"weights": sum(d["weight_bytes"] for d in devices), "kv": sum(d["kv_bytes"] for d in devices)}


def prompt(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(3, VOCAB, n)]


def active_sessions(path: str) -> dict:
    """RSS growth per decoding session, at 1, 8 and 32 sessions."""
    rng = np.random.default_rng(1)
    n_seq = max(ACTIVE) + 8
    with NodeProcess(path, "--n-seq-max", str(n_seq), "--max-active", str(max(ACTIVE)), "--ctx", str(n_seq * 1024),
                     "--prefix-cache", "off", "--log-level", "WARNING") as node, node.client(timeout_s=600) as c:
        c.generate("warm", tokens=[3, 4, 5], max_tokens=4)
        info = c.status()["node"]
        base = rss(node)
        out = {"idle": base, "llama_cpp": llama_buffers(info), "n_seq_max": n_seq,
               "kv_bytes_per_token": info["kv_bytes_per_token"], "levels": {}}
        for k in ACTIVE:
            ids = [f"a{k}-{i}" for i in range(k)]
            for sid in ids:
                c.submit(sid, tokens=prompt(rng, PROMPT), max_tokens=1024 - PROMPT - 8, ignore_eos=True)
            for sid in ids:  # every one past its prompt and decoding
                c.wait_for(lambda e, sid=sid: e["event"] == "tokens" and e["id"] == sid, keep=True)
            now, cells = rss(node), c.status()["telemetry"]["engine"]["kv_cells"]
            for sid in ids:
                c.cancel(sid)
            c.collect(ids)
            out["levels"][str(k)] = {"rss": now, "kv_cells": cells,
                                     "front_per_session": (now["front"] - base["front"]) / k,
                                     "engine_per_session": (now["engine"] - base["engine"]) / k,
                                     "llama_cpp_kv_for_cells_per_session": cells * info["kv_bytes_per_token"] / k}
        out["llama_cpp_kv_per_sequence"] = out["llama_cpp"]["kv"] / n_seq
    return out


def kv_types(path: str) -> dict:
    """Per KV type: bytes a token as budgeted, llama.cpp's KV buffer, the engine's RSS at idle."""
    out = {}
    for t in ("f16", "q8_0", "q4_0"):
        with NodeProcess(path, "-ctk", t, "-ctv", t, "--log-level", "WARNING") as node, node.client() as c:
            c.generate("warm", tokens=[3, 4, 5], max_tokens=2)
            info, resident = c.status()["node"], rss(node)["engine"]
        llama = llama_buffers(info)["kv"]
        per_token = info["kv_bytes_per_token"]
        out[t] = {"kv_bytes_per_token": per_token, "budget_bytes": info["budgets"]["kv_budget_bytes"],
                  "llama_cpp_kv_bytes": llama, "budget_over_llama_cpp": info["budgets"]["kv_budget_bytes"] / llama,
                  "engine_rss": resident, "sessions_of_4096_in_4gib": (4 << 30) // (per_token * 4096)}
    for t in out:
        out[t]["rss_saved_vs_f16"] = out["f16"]["engine_rss"] - out[t]["engine_rss"]
        out[t]["kv_saved_vs_f16"] = out["f16"]["llama_cpp_kv_bytes"] - out[t]["llama_cpp_kv_bytes"]
    return out


def conversations(path: str) -> dict:
    """100 users' two turns through one node: the second turn's hits and the RSS each kept conversation adds."""
    rng = np.random.default_rng(2)
    n_seq = USERS + 2 * WAVE
    with NodeProcess(path, "--n-seq-max", str(n_seq), "--max-active", str(WAVE), "--ctx", str(n_seq * 512),
                     "--log-level", "WARNING") as node, node.client(timeout_s=600) as c:
        c.generate("warm", tokens=[3, 4, 5], max_tokens=2)
        system = prompt(rng, SYSTEM)
        history = {u: system + prompt(rng, NEW) for u in range(USERS)}
        before = rss(node)
        turn(c, history, "t1")
        kept = c.status()["telemetry"]["prefix_cache"]
        after = rss(node)
        for u in history:
            history[u] = history[u] + prompt(rng, NEW)
        second = turn(c, history, "t2")
        cache = c.status()["telemetry"]["prefix_cache"]
    reused = [second[u]["cached_tokens"] for u in second]
    return {"users": USERS, "system": SYSTEM, "new": NEW, "answer": ANSWER, "wave": WAVE,
            "entries_after_turn_1": kept["entries"], "rss_before": before, "rss_after_turn_1": after,
            "front_per_conversation": (after["front"] - before["front"]) / max(1, kept["entries"]),
            "engine_per_conversation": (after["engine"] - before["engine"]) / max(1, kept["entries"]),
            "turn_2_hits": sum(1 for n in reused if n > 0), "turn_2_reused_median": float(np.median(reused)),
            "turn_2_prompt_median": float(np.median([second[u]["prompt_tokens"] for u in second])),
            "evictions_total": cache["evictions_total"], "hit_token_ratio": cache["hit_token_ratio"]}


def turn(c, history: dict, tag: str) -> dict:
    """Every user's turn, WAVE at a time; each answer joins its user's history. Returns each done."""
    dones = {}
    users = list(history)
    for i in range(0, len(users), WAVE):
        ids = {f"{tag}-{u}": u for u in users[i:i + WAVE]}
        for sid, u in ids.items():
            c.submit(sid, tokens=history[u], max_tokens=ANSWER, ignore_eos=True)
        for sid, r in c.collect(list(ids)).items():
            u = ids[sid]
            history[u] = history[u] + r.done["tokens"]
            dones[u] = r.done["usage"]
    return dones


def lookup_us(entries: int, length: int = SYSTEM + 2 * (NEW + ANSWER), reps: int = 200) -> float:
    """PrefixCache.find over `entries` conversations sharing a system prompt, for the next turn of one of them."""
    from meshnode.core.prefix import PrefixCache

    rng = np.random.default_rng(3)
    cache = PrefixCache("node")
    system = list(rng.integers(3, VOCAB, SYSTEM))
    convs = [system + list(rng.integers(3, VOCAB, length - SYSTEM)) for _ in range(entries)]
    for i, toks in enumerate(convs):
        cache.store(i, toks, len(toks), "u", n_prompt=len(toks) - ANSWER)
    query = convs[entries // 2] + list(rng.integers(3, VOCAB, NEW))
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cache.find(query, "u", [])
        t.append(time.perf_counter() - t0)
    return float(np.median(t) * 1e6)


def main(a) -> int:
    path = model_path(a)
    print(f"bench memory: {path}; {llama_build()}", flush=True)
    act = active_sessions(path)
    kv_seq = act["llama_cpp_kv_per_sequence"]
    print(f"idle: front {act['idle']['front'] / MIB:.1f} MiB, engine {act['idle']['engine'] / MIB:.1f} MiB; llama.cpp's "
          f"buffers: weights {act['llama_cpp']['weights'] / MIB:.1f} MiB, KV {act['llama_cpp']['kv'] / MIB:.1f} MiB "
          f"({act['n_seq_max']} sequences, {kv_seq / MIB:.2f} MiB each)")
    for k, lv in act["levels"].items():
        over = (lv["front_per_session"] + lv["engine_per_session"]) / kv_seq
        print(f"  {k:>2} decoding: per session front {lv['front_per_session'] / 1024:+.0f} KiB, engine "
              f"{lv['engine_per_session'] / 1024:+.0f} KiB (= {over:+.2%} of one sequence's KV; the KV its "
              f"{lv['kv_cells'] // int(k)} cells take: {lv['llama_cpp_kv_for_cells_per_session'] / MIB:.2f} MiB)")
    kv = kv_types(path)
    for t, k in kv.items():
        print(f"KV {t}: {k['kv_bytes_per_token']} B a token as budgeted; budget {k['budget_bytes'] / MIB:.1f} MiB vs "
              f"llama.cpp's buffer {k['llama_cpp_kv_bytes'] / MIB:.1f} MiB ({k['budget_over_llama_cpp']:.3f}x); engine "
              f"RSS {k['engine_rss'] / MIB:.1f} MiB, {k['rss_saved_vs_f16'] / MIB:.1f} MiB under f16 where the buffers "
              f"differ by {k['kv_saved_vs_f16'] / MIB:.1f} MiB; {k['sessions_of_4096_in_4gib']} sessions of 4,096 "
              "tokens in 4 GiB")
    conv = conversations(path)
    print(f"{conv['users']} conversations kept ({conv['entries_after_turn_1']} cache entries): per conversation front "
          f"{conv['front_per_conversation'] / 1024:+.1f} KiB, engine {conv['engine_per_conversation'] / 1024:+.1f} KiB; "
          f"second turns: {conv['turn_2_hits']} of {conv['users']} hit, median {conv['turn_2_reused_median']:.0f} of "
          f"{conv['turn_2_prompt_median']:.0f} prompt tokens reused, {conv['evictions_total']} evictions")
    lookups = {n: lookup_us(n) for n in (10, 100, 250)}
    print("lookup (PrefixCache.find, median): " + ", ".join(f"{n} entries {us:.0f} us" for n, us in lookups.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"build": llama_build(), "model": path, "active": act, "kv_types": kv, "conversations": conv,
                       "lookup_us": lookups}, f, indent=1)
    return 0
