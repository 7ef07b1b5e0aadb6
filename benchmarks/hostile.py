"""`python -m benchmarks hostile`: hostile KV states and frames against a node while another client streams.

On each KV layout (streams, with deterministic mode; unified, without it), node A exports a running session
and its honest state file is the seed: node B gets the named edits of meshnode/dev/hostile.py and
`--hostile` seeded random edits of its structure, each with the SHA-256 its sender computed, then
`--hostile` random frames (msgpack trees over every op and field, response_format schemas holding bin
values and keys or nested 1,000 deep, raw bytes). Meanwhile a victim (another client) generates on B; it is
compared with its lone run, bitwise where deterministic mode holds. Goal (issue 66): 0 engine or front
exits, 0 victims changed or ended, every hostile request answered with a reason.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections import Counter

import msgpack

from ipc import protocol as P
from meshnode.bench import llama_build, model_path
from meshnode.core import reasons as R
from meshnode.core.types import Sampling
from meshnode.dev.hostile import mesh_key, random_edits, send_state, state_variants
from meshnode.dev.nodeproc import NodeProcess
from meshnode.front.moves import read_key

PROMPT = [3 + (k * 29) % 500 for k in range(37)]
LEAVER = dict(tokens=PROMPT, max_tokens=200, ignore_eos=True, sampling=Sampling(0.9, 40, 0.95, 11))
VICTIM = dict(tokens=[5 + (k * 13) % 400 for k in range(21)], ignore_eos=True, sampling=Sampling(0.8, 40, 0.95, 3))
MODES = {"streams": ("--deterministic",), "unified": ("--no-deterministic",)}


def _deep(n: int) -> bytes:
    level = b"\x81" + msgpack.packb("properties") + b"\x81" + msgpack.packb("a")
    return level * n + msgpack.packb({"type": "object"})


def _tree(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 3 or roll < 0.5:
        return rng.choice([None, True, -1, 2**63, 1.5, float("nan"), "x" * rng.randrange(20), b"\x00bin",
                           rng.randrange(-5, 600)])
    if roll < 0.75:
        return [_tree(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["type", "schema", "id", "a", "tokens"]): _tree(rng, depth + 1) for _ in range(rng.randrange(4))}


def hostile_frames(n: int, seed: int) -> list[list[bytes]]:
    """`n` seeded frames no valid client sends."""
    rng, out = random.Random(seed), []
    fields = ["tokens", "text", "max_tokens", "sampling", "stop_tokens", "stop", "response_format", "messages",
              "tools", "embed", "kv", "generated", "priority", "logprobs", "recipe", "offset", "data"]
    for i in range(n):
        roll = rng.random()
        if roll < 0.1:
            out.append([P.VERSION, bytes(rng.randrange(256) for _ in range(rng.randrange(64)))])
            continue
        if roll < 0.2:
            schema = rng.choice([_deep(500), msgpack.packb({b"type": "string"}, use_bin_type=True),
                                 msgpack.packb({"default": b"\x01"}, use_bin_type=True)])
            head = msgpack.packb({"op": "submit", "id": f"f{i}", "text": "hi", "max_tokens": 4})
            out.append([P.VERSION, b"\x85" + head[1:] + msgpack.packb("response_format") + b"\x82"
                        + msgpack.packb("type") + msgpack.packb("json_schema") + msgpack.packb("schema") + schema])
            continue
        msg = {"op": rng.choice(["submit", "import", "kv", "cancel", "export", "status", "nope"]), "id": f"f{i}"}
        for f in rng.sample(fields, rng.randrange(1, 6)):
            msg[f] = _tree(rng)
        if rng.random() < 0.3:
            msg["response_format"] = {"type": "json_schema", "schema": _tree(rng)}
        out.append([P.VERSION, msgpack.packb(msg, use_bin_type=True)])
    return out


def _send_frame(c, frames: list[bytes]) -> str:
    """One hostile frame: the kind of answer it got ('error', 'rejected', 'admitted', 'status', ...)."""
    c.sock.send_multipart(frames)
    if not c.sock.poll(30_000):
        return "no answer"
    ev = msgpack.unpackb(c.sock.recv_multipart()[1], raw=False, strict_map_key=False)
    kind = ev.get("event", "?")
    if kind == "admitted":  # a random tree that made a valid request: it runs to its end, as anyone's
        sid = ev["id"]
        c.open[sid] = c.open.get(sid, 0) + 1
        c.collect([sid], timeout_s=120)
    return f"{kind} {ev.get('code') or ev.get('reason') or ''}".strip()


def run_layout(path: str, layout: str, threads: int, n: int) -> dict:
    keyfile = mesh_key(tempfile.mkdtemp())  # one mesh, and the attacker a member of it: the parse is what is left
    args = ("--threads", str(threads), "--decode-steps-ms", "0", "--kv-layout", layout, *MODES[layout],
            "--log-level", "WARNING", "--mesh-key-file", keyfile)
    key = read_key(keyfile)
    with NodeProcess(path, *args) as a, NodeProcess(path, *args) as b, a.client(600) as ca, \
            b.client(600) as attacker, b.client(600) as victim:
        ca.submit("leaver", **LEAVER)
        ca.wait_for(lambda e: e["event"] == "tokens" and e["id"] == "leaver", keep=True)
        state = ca.export("leaver")
        ca.collect(["leaver"])
        data = state["kv"]["data"]
        files = list(state_variants(data).values()) + random_edits(data, n, seed=7)
        frames = hostile_frames(n, seed=11)
        victim_tokens = 40 + 2 * (len(files) + len(frames)) // 10  # long enough to stream through the flood
        lone = victim.generate("lone", max_tokens=victim_tokens, **VICTIM)
        victim.submit("v", max_tokens=victim_tokens, **VICTIM)
        t0 = time.perf_counter()
        states = Counter()
        for i, bad in enumerate(files):
            ans = send_state(attacker, f"h{i}", state, bad, timeout_s=120, key=key)
            if ans["event"] == "admitted":
                attacker.collect([f"h{i}"], timeout_s=120)
            states[ans["event"] + (" with a reason" if ans.get("detail") else "")] += 1
        state_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        answers = Counter(_send_frame(attacker, f) for f in frames)
        frame_s = time.perf_counter() - t0
        went = victim.collect(["v"], timeout_s=600)["v"]
        t = victim.status()["telemetry"]
        after = victim.generate("after", max_tokens=victim_tokens, **VICTIM)
        alive = a.proc.poll() is None and b.proc.poll() is None
    bitwise = layout == "streams"
    return {"layout": layout, "deterministic": bitwise, "state_files": len(files), "state_outcomes": dict(states),
            "state_s": state_s, "frames": len(frames), "frame_outcomes": dict(answers), "frame_s": frame_s,
            "victim_reason": went.done["reason"], "victim_bitwise": went.done["tokens"] == lone.done["tokens"],
            "after_bitwise": after.done["tokens"] == lone.done["tokens"], "restarts": t["engine"]["restarts"],
            "healthy": t["healthy"], "nodes_alive": alive}


def main(a) -> int:
    path = model_path(a)
    n = a.hostile
    print(f"bench hostile: {os.path.basename(path)}, threads {a.threads or 'all'}, {n} random state edits and "
          f"{n} random frames a layout; {llama_build()}")
    rows = [run_layout(path, layout, a.threads, n) for layout in MODES]
    ok = True
    for r in rows:
        print(f"\n{r['layout']} (deterministic {r['deterministic']}): {r['state_files']} state files in "
              f"{r['state_s']:.1f} s, {r['frames']} frames in {r['frame_s']:.1f} s")
        for k, v in sorted(r["state_outcomes"].items()):
            print(f"  state file -> {k}: {v}")
        for k, v in sorted(r["frame_outcomes"].items()):
            print(f"  frame -> {k}: {v}")
        print(f"  victim: done {r['victim_reason']}, bitwise its lone run {r['victim_bitwise']}; a session after: "
              f"bitwise {r['after_bitwise']}; engine restarts {r['restarts']}, healthy {r['healthy']}, "
              f"both nodes alive {r['nodes_alive']}")
        ok &= (r["victim_reason"] == R.LENGTH and r["restarts"] == 0 and r["healthy"] and r["nodes_alive"]
               and "no answer" not in r["frame_outcomes"] and "rejected" not in r["state_outcomes"]
               and (r["victim_bitwise"] and r["after_bitwise"] or not r["deterministic"]))
    print(f"\ngoal (0 exits, 0 victims changed or ended, every hostile request answered with a reason): "
          f"{'met' if ok else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": os.path.basename(path), "build": llama_build(), "rows": rows, "goal_met": ok}, f,
                      indent=1)
    return 0 if ok else 1
