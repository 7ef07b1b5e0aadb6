"""Multi-turn chat: what the prefix cache saves when clients re-send the whole conversation.

By default 8 users talk at once, 6 turns each: turn 1 is a 200-token system prompt (the same for
all) plus 48 user tokens; every later turn re-sends the history (prompt + the 24 tokens the model
answered) plus 48 new tokens (`--users --turns --system --new --answer`). Each round runs the
node with the prefix cache on, with it off, and, given `--llama-server PATH`, llama.cpp's own
server (prompt caching on, one slot per user) on the same model and threads, one after the other.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from meshnode.bench import llama_build, model_path
from meshnode.bench.llama_server import LlamaServer
from meshnode.dev.nodeproc import NodeProcess

@dataclass(frozen=True)
class Workload:
    users: int = 8
    turns: int = 6
    system: int = 200  # tokens of the system prompt all users share
    new: int = 48  # user tokens added each turn
    gen: int = 24  # tokens answered each turn

    @property
    def ctx(self) -> int:
        """Cells for every user's longest conversation, in llama-server's slots too (it splits ctx by users)."""
        longest = self.system + self.turns * (self.new + self.gen)
        return self.users * 256 * -(-longest // 256)


class Conversations:
    """The users' histories and per-turn timings, filled in by whichever server answers."""

    def __init__(self, w: Workload):
        self.w = w
        self.history = {u: [3 + (k * 37) % 500 for k in range(w.system)] for u in range(w.users)}
        self.answers: dict[tuple[int, int], list[int]] = {}
        self.ttft_ms: dict[int, list[float]] = {t: [] for t in range(w.turns)}
        self.cached = 0

    def prompt(self, u: int, turn: int) -> list[int]:
        self.history[u] = self.history[u] + [3 + (u * 131 + turn * 17 + k * 7) % 500 for k in range(self.w.new)]
        return self.history[u]

    def answered(self, u: int, turn: int, tokens: list[int], ttft_ms: float) -> None:
        self.answers[(u, turn)] = tokens
        self.history[u] = self.history[u] + tokens
        self.ttft_ms[turn].append(ttft_ms)


def through_node(w: Workload, path: str, threads: int, scope: str, extra: tuple = ()) -> tuple[Conversations, float]:
    conv = Conversations(w)
    args = ["--max-active", str(w.users), "--ctx", str(w.ctx), "--threads", str(threads), "--prefix-cache", scope,
            "--log-level", "WARNING", *extra]
    with NodeProcess(path, *args) as node, node.client(timeout_s=600) as c:
        sent, first, got = {}, {}, {}
        t0 = time.monotonic()

        def submit(u: int, turn: int) -> None:
            sid = f"u{u}t{turn}"
            sent[sid], got[sid] = time.monotonic(), []
            c.submit(sid, tokens=conv.prompt(u, turn), max_tokens=w.gen, ignore_eos=True)

        for u in range(w.users):
            submit(u, 0)
        left = w.users * w.turns
        while left:
            ev = c.recv(600)
            if ev is None:
                raise TimeoutError("node stopped answering")
            sid = ev.get("id", "")
            if ev["event"] == "tokens":
                first.setdefault(sid, time.monotonic())
            elif ev["event"] == "rejected":
                raise RuntimeError(f"{sid} rejected: {ev['detail']}")
            elif ev["event"] == "done":
                left -= 1
                u, turn = (int(x) for x in sid[1:].split("t"))
                conv.cached += ev["usage"].get("cached_tokens", 0)
                conv.answered(u, turn, ev["tokens"], (first[sid] - sent[sid]) * 1e3)
                if turn + 1 < w.turns:
                    submit(u, turn + 1)
        return conv, time.monotonic() - t0


def through_llama_server(w: Workload, binary: str, path: str, threads: int) -> tuple[Conversations, float]:
    with LlamaServer(binary, path, threads, slots=w.users, ctx=w.ctx) as server:
        conv = Conversations(w)

        def user(u: int) -> None:
            for turn in range(w.turns):
                tokens, ttft = server.complete(conv.prompt(u, turn), w.gen)
                conv.answered(u, turn, tokens, ttft)

        t0 = time.monotonic()
        workers = [threading.Thread(target=user, args=(u,)) for u in range(w.users)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        return conv, time.monotonic() - t0


def figures(conv: Conversations, wall: float) -> dict:
    turns = range(conv.w.turns)
    later = [x for t in turns[1:] for x in conv.ttft_ms[t]]
    return {"wall_s": round(wall, 2), "cached_tokens": conv.cached,
            "ttft_ms_p50_by_turn": [round(float(np.percentile(conv.ttft_ms[t], 50))) for t in turns],
            "ttft_ms_p90_by_turn": [round(float(np.percentile(conv.ttft_ms[t], 90))) for t in turns],
            "ttft_ms_p50_later_turns": round(float(np.percentile(later, 50)))}


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    w = Workload(a.users, a.turns, a.system, a.new, a.answer)
    print(f"model {os.path.basename(path)}  {w.users} users x {w.turns} turns (system {w.system}, +{w.new} per turn, "
          f"{w.gen} generated), threads {threads}, {llama_build()}")
    rounds = []
    for r in range(a.rounds):
        runs = {}
        for scope in ("client", "off") if r % 2 == 0 else ("off", "client"):  # neither always goes first
            runs[scope] = through_node(w, path, threads, scope)
        (on, on_wall), (off, off_wall) = runs["client"], runs["off"]
        row = {"cache_on": figures(on, on_wall), "cache_off": figures(off, off_wall),
               "identical_answers": sum(on.answers[k] == off.answers[k] for k in on.answers)}
        if a.llama_server:
            srv, srv_wall = through_llama_server(w, a.llama_server, path, threads)
            row["llama_server"] = figures(srv, srv_wall)
        rounds.append(row)
        print(f"round {r + 1}")
        for name in ("cache_on", "cache_off", "llama_server"):
            if name in row:
                f = row[name]
                print(f"  {name:<13} wall {f['wall_s']:7.2f} s  TTFT p50 turns 2+ {f['ttft_ms_p50_later_turns']:6d} ms"
                      f"  p50 by turn {f['ttft_ms_p50_by_turn']}  reused {f['cached_tokens']:,} tokens")
        print(f"  on/off speed-up {off_wall / on_wall:.2f}x   answers identical on vs off: "
              f"{row['identical_answers']}/{w.users * w.turns}")
    speedups = [r["cache_off"]["wall_s"] / r["cache_on"]["wall_s"] for r in rounds]
    print(f"cache on vs off, wall: {min(speedups):.2f}x-{max(speedups):.2f}x over {len(rounds)} rounds "
          f"(target >= 2x: {'met' if min(speedups) >= 2 else 'NOT met'})")
    if a.llama_server:
        for key, label in (("wall_s", "wall"), ("ttft_ms_p50_later_turns", "TTFT p50 turns 2+")):
            ratio = [r["cache_on"][key] / r["llama_server"][key] for r in rounds]
            print(f"node / llama-server, {label}: {min(ratio):.2f}-{max(ratio):.2f} "
                  f"(target <= 1: {'met' if max(ratio) <= 1 else 'NOT met'})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "workload": w.__dict__,
                       "llama_server": a.llama_server,
                       "rounds": rounds}, f, indent=2)
    return 0
