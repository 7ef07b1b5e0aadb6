"""`python -m benchmarks spec`: one user alone, the node's defaults beside llama-server's, on chats and a code edit.

What a user meets first: one session, greedy, on a real model. Tasks, as the model's chat template renders them
(the same prompt tokens to every side), each answer ending where the model ends its turn or at `--tokens`
(default 256), so each side generates its own greedy answer, as a user would get it:
- eight free chats (`CHATS`: questions, a story, an email, a recipe, code to write): what speculation cannot
  copy from the prompt; each answer's `repeats` (the share of its tokens a lookup of the text before it
  guesses) says how much of it repeats itself, which 135M models often do;
- `code-edit`: a 40-line Python file asked back with one function renamed (output that copies its prompt);
- `crowd` (node only, unless `--sides`): 8 code edits at once, the node's default vs `--spec off`.
Sides, in an order that rotates each round: the node's defaults, `--spec off`, `--deterministic` (what the
mode costs where it is asked for), and llama-server from the same llama.cpp (same threads and context) with its
defaults, `--spec-type ngram-simple` and `ngram-mod`; named in `--sides`, also `--spec off` with one decode
step a tick (`--decode-steps-ms 0`: what multi-step ticks buy). Measured: decode tok/s from the first token to the last
(prefill excluded), drafts verified and accepted.
"""
from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from meshnode.bench import llama_build, model_path
from meshnode.bench.llama_server import LlamaServer
from meshnode.dev.nodeproc import NodeProcess

CODE = '''def compute_total(items, tax_rate):
    """Sum the prices of the items and add tax."""
    subtotal = 0.0
    for item in items:
        price = item["price"]
        quantity = item.get("quantity", 1)
        subtotal += price * quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def format_receipt(items, tax_rate):
    lines = []
    for item in items:
        name = item["name"]
        price = item["price"]
        quantity = item.get("quantity", 1)
        lines.append(f"{name:20s} {quantity:3d} x {price:8.2f}")
    total = compute_total(items, tax_rate)
    lines.append(f"{'TOTAL':20s} {total:14.2f}")
    return "\\n".join(lines)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best


def main():
    items = [
        {"name": "apple", "price": 0.5, "quantity": 6},
        {"name": "bread", "price": 2.25},
        {"name": "cheese", "price": 7.8, "quantity": 2},
    ]
    print(format_receipt(items, 0.08))
    print("cheapest:", cheapest(items)["name"])
    print("total:", compute_total(items, 0.08))
'''
NAMES = ("sum_prices", "total_cost", "grand_total", "add_tax", "price_sum", "order_total", "checkout", "bill")
CHATS = {
    "habits": "What are three good habits for staying healthy while working from home? Explain each briefly.",
    "bicycle": "How does a bicycle stay upright when it moves?",
    "story": "Write a short story about a cat who learns to swim.",
    "tuple": "What is the difference between a list and a tuple in Python?",
    "pancakes": "Give me a simple recipe for pancakes.",
    "email": "Write a polite email to my manager asking for a day off next Friday.",
    "photosynthesis": "Explain photosynthesis to a ten-year-old.",
    "sql": "Write a SQL query that lists the five customers who spent the most last month, and explain it.",
}
NODE_SIDES = {"node default": (), "node spec off": ("--spec", "off"), "node deterministic": ("--deterministic",)}
# named in --sides only: one token a tick (core/steps.py off), what the multi-step ticks buy
ONE_STEP = {"node spec off, one step a tick": ("--spec", "off", "--decode-steps-ms", "0")}
SERVER_SIDES = {"llama-server default": (), "llama-server ngram-simple": ("--spec-type", "ngram-simple"),
                "llama-server ngram-mod": ("--spec-type", "ngram-mod")}
CTX = 8192
EOT = (0, 2)  # SmolLM2's <|endoftext|>, <|im_end|>: where a chat answer ends


def edit(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Rewrite this code with the function compute_total renamed to {name}. "
                                        f"Answer with the whole code only.\n\n```python\n{CODE}```"}]


def prompts(path: str) -> dict[str, list[int]]:
    from meshnode.text.tokenizer import Tokenizer

    tok = Tokenizer(path)
    render = lambda msgs: [t for s in tok.prompt_slices(tok.chat_prompt(msgs)) for t in s]  # noqa: E731
    out = {"code-edit": render(edit(NAMES[0]))}
    out |= {name: render([{"role": "user", "content": q}]) for name, q in CHATS.items()}
    out |= {f"crowd{i}": render(edit(n)) for i, n in enumerate(NAMES)}
    tok.close()
    return out


def rate(times: list[float]) -> float:
    """Decode tokens a second: those that arrived after the first event (a node's event may carry several),
    over the time from the first to the last."""
    return sum(t > times[0] for t in times) / max(times[-1] - times[0], 1e-9)


def repeats(prompt: list[int], answer: list[int]) -> float:
    """The share of the answer's tokens that the text before each (prompt and answer so far) predicts: what
    followed the latest earlier occurrence of its last 3 tokens. High on text that repeats itself or its prompt."""
    seen, toks, hits = {}, list(prompt), 0
    for e in range(2, len(toks) - 1):
        seen[tuple(toks[e - 2:e + 1])] = e + 1
    for t in answer:
        q = seen.get(tuple(toks[-3:]))
        hits += q is not None and toks[q] == t
        toks.append(t)
        seen[tuple(toks[-4:-1])] = len(toks) - 1
    return hits / max(1, len(answer))


def node_side(path: str, threads: int, args: tuple, work: dict, n: int, crowd: bool) -> dict:
    out = {}
    with NodeProcess(path, "--threads", str(threads), "--ctx", str(CTX), "--log-level", "WARNING", *args) as node, \
            node.client(timeout_s=900) as c:
        c.generate("warm", tokens=[3, 4, 5], max_tokens=4, ignore_eos=True)
        for task in ["code-edit", *CHATS]:
            before = c.status()["telemetry"]["engine"]
            r = c.generate(task, tokens=work[task], max_tokens=n)
            e = c.status()["telemetry"]["engine"]
            out[task] = {"tok_s": rate(r.token_times), "tokens": r.tokens,
                         "drafted": e["drafted_rows_total"] - before["drafted_rows_total"],
                         "accepted": e["drafts_served_total"] - before["drafts_served_total"]}
        out["deterministic"] = c.status()["node"]["deterministic"]
        if crowd:
            keys = [k for k in work if k.startswith("crowd")]
            before = c.status()["telemetry"]["engine"]
            t0 = time.monotonic()
            for k in keys:
                c.submit(k, tokens=work[k], max_tokens=n, ignore_eos=True)
            got = c.collect(keys)
            e = c.status()["telemetry"]["engine"]
            out["crowd"] = {"tok_s": sum(len(g.tokens) for g in got.values()) / (time.monotonic() - t0),
                            "tokens": [got[k].tokens for k in keys],
                            "drafted": e["drafted_rows_total"] - before["drafted_rows_total"],
                            "accepted": e["drafts_served_total"] - before["drafts_served_total"]}
    return out


def server_side(binary: str, path: str, threads: int, args: tuple, work: dict, n: int) -> dict:
    out = {}
    with LlamaServer(binary, path, threads, slots=1, ctx=CTX, extra=args) as server:
        for task in ["code-edit", *CHATS]:
            times, final = [], {}
            toks, _ = server.complete(work[task], n, on_token=times.append, final=final, cache_prompt=False,
                                      ignore_eos=False)
            t = final.get("timings", {})
            out[task] = {"tok_s": rate(times), "tokens": toks, "drafted": t.get("draft_n", 0),
                         "accepted": t.get("draft_n_accepted", 0), "server_tok_s": t.get("predicted_per_second")}
    return out


def main(a) -> int:
    threads = a.threads or os.cpu_count()
    path = model_path(a)
    n = a.tokens if a.tokens != 32 else 256
    work = prompts(path)
    print(f"bench spec: {os.path.basename(path)}, one session alone, greedy, up to {n} new tokens (to the end of "
          f"the turn); code-edit prompt {len(work['code-edit'])} tokens, {len(CHATS)} chats of "
          f"{min(len(work[c]) for c in CHATS)}-{max(len(work[c]) for c in CHATS)}; threads {threads}, {a.rounds} "
          f"rounds; {llama_build()}", flush=True)
    node_sides, server_sides = dict(NODE_SIDES), dict(SERVER_SIDES)
    if a.draft_model:  # the model's draft (llama-server's -md) beside the lookup
        from meshnode.ops import realmodel

        draft = str(realmodel.real_model(a.draft_model)) if a.draft_model in realmodel.NAMES else a.draft_model
        node_sides["node draft model"] = ("--draft-model", draft)
        server_sides["llama-server draft model"] = ("-md", draft, "--spec-type", "draft-simple")
    from meshnode.engine.llamacpp import deterministic_problem

    refused = deterministic_problem(path)
    if refused:  # the node refuses --deterministic for these weights (exit 2): no such side
        print(f"  (no 'node deterministic' side: {refused})", flush=True)
        del node_sides["node deterministic"]
    sides = list(node_sides) + (list(server_sides) if a.llama_server else [])
    if a.sides:
        node_sides |= ONE_STEP
        sides = [s for s in [*sides, *ONE_STEP] if s in a.sides.split(";")]
    rounds = []
    for r in range(a.rounds):
        got = {}
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            if side in node_sides:
                got[side] = node_side(path, threads, node_sides[side], work, n,
                                      crowd=not a.sides and side in ("node default", "node spec off"))
            else:
                got[side] = server_side(a.llama_server, path, threads, server_sides[side], work, n)
            print(f"  ... {side} done", flush=True)
        rounds.append(got)
        for side in sides:
            line = "  ".join(f"{t} {got[side][t]['tok_s']:5.1f}" for t in ["code-edit", *CHATS])
            cr = got[side].get("crowd")
            print(f"  round {r + 1} {side:<26} {line}" + (f"  crowd of 8 {cr['tok_s']:5.1f}" if cr else ""),
                  flush=True)
    verdicts = summary(rounds, sides, work)
    for line in verdicts:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "new_tokens": n,
                       "prompt_tokens": {k: len(v) for k, v in work.items()},
                       "rounds": [{s: {t: ({k: v for k, v in f.items() if k != "tokens"} if isinstance(f, dict) else f)
                                       for t, f in side.items()} for s, side in rd.items()} for rd in rounds],
                       "verdicts": verdicts}, f, indent=1)
    return 0


def summary(rounds: list[dict], sides: list[str], work: dict) -> list[str]:
    """The ratios issue 52's goals name, for the sides this run had: each chat's and their geometric mean,
    the code edit against llama-server's best, speculation against none."""
    med = lambda side, task: float(np.median([rd[side][task]["tok_s"] for rd in rounds]))  # noqa: E731
    ratios = lambda a, b, task: [rd[a][task]["tok_s"] / rd[b][task]["tok_s"] for rd in rounds]  # noqa: E731
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    out = []
    first = rounds[0]
    for side in [s for s in sides if s.startswith("node") or s == "llama-server default"]:
        reps = {t: repeats(work[t], first[side][t]["tokens"]) for t in CHATS}
        out.append(f"{side}: answer lengths " + ", ".join(f"{t} {len(first[side][t]['tokens'])}" for t in CHATS)
                   + "; repeats " + ", ".join(f"{t} {reps[t]:.2f}" for t in CHATS))
        if "deterministic" in first[side]:
            out.append(f"{side}: deterministic mode {'on' if first[side]['deterministic'] else 'off'}")
    out += edit_answers(rounds, sides, work)
    base = "llama-server default"
    for node in [s for s in sides if s.startswith("node")]:
        if base in sides:
            per = {t: float(np.median(ratios(node, base, t))) for t in CHATS}
            out.append(f"{node} / {base} on chats: geometric mean {geo(list(per.values())):.2f}x (goal >= 1.0x); "
                       + ", ".join(f"{t} {x:.2f}x" for t, x in per.items()))
            best = max([s for s in sides if s.startswith("llama-server")], key=lambda s: med(s, "code-edit"))
            xs = ratios(node, best, "code-edit")
            out.append(f"{node} / {best} (llama-server's best) on code-edit: {np.median(xs):.2f}x (rounds "
                       + ", ".join(f"{x:.2f}" for x in xs) + ") (goal >= 1.5x)")
    if "node default" in sides and "node spec off" in sides:
        per = {t: float(np.median(ratios("node default", "node spec off", t))) for t in ["code-edit", *CHATS]}
        line = "node default (spec auto) / node spec off: " + ", ".join(f"{t} {x:.2f}x" for t, x in per.items())
        if "crowd" in first["node default"]:
            line += f", crowd of 8 {np.median(ratios('node default', 'node spec off', 'crowd')):.2f}x"
        out.append(line)
    for s in sides:
        acc = sum(rd[s][t]["accepted"] for rd in rounds for t in ["code-edit", *CHATS])
        dr = sum(rd[s][t]["drafted"] for rd in rounds for t in ["code-edit", *CHATS])
        out.append(f"{s}: code-edit {med(s, 'code-edit'):.1f} tok/s, chats' median "
                   f"{np.median([med(s, t) for t in CHATS]):.1f} tok/s; drafts accepted {acc}/{dr}")
    return out


def edit_answers(rounds: list[dict], sides: list[str], work: dict) -> list[str]:
    """What each side's code-edit answer was, round by round: its length, its `repeats` share, and how many of its
    first tokens it shares with `node spec off`'s answer that round (or llama-server default's). Greedy answers
    of a model that does not copy the file part with the batch shapes each side's drafts give (the kernels are
    not batch-invariant outside deterministic mode), so a code-edit ratio compares the speeds of different texts
    wherever these differ."""
    ref = next((s for s in ("node spec off", "llama-server default") if s in sides), sides[0])
    out = []
    for i, rd in enumerate(rounds):
        base = rd[ref]["code-edit"]["tokens"]
        cells = []
        for s in sides:
            t = rd[s]["code-edit"]["tokens"]
            same = next((k for k, (x, y) in enumerate(zip(t, base)) if x != y), min(len(t), len(base)))
            cells.append(f"{s} {len(t)}/{repeats(work['code-edit'], t):.2f}/{same}")
        out.append(f"code-edit answers, round {i + 1} (length/repeats/tokens shared with {ref}'s): "
                   + ", ".join(cells))
    return out
