"""`python -m benchmarks spec`: one user alone, the node's speculative decoding beside llama-server's.

Tasks, as a chat model's rendered prompt tokens (the same tokens sent to every side), greedy, `--tokens`
new tokens each (past EOS: every side does the same work):
- `code-edit`: a 40-line Python file, asked back with one function renamed (output that repeats its prompt);
- `chat`: a free question (little to look up);
- `crowd` (node only): 8 sessions at once, each a code-edit with another name: speculation auto vs off where
  the cost model should keep batched throughput (no drafts where they do not pay).
Sides, in an order that rotates each round: the node deterministic (the default) with `--spec off` and
`auto`, the node `--no-deterministic` with both, and llama-server from the same llama.cpp (same threads and
context) with no speculation, `--spec-type ngram-simple` and `ngram-mod`. Measured: decode tok/s from the
first token to the last (prefill excluded), drafts verified and accepted, and whether each side's tokens
equal its own without speculation.
"""
from __future__ import annotations

import json
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
CHAT = "What are three good habits for staying healthy while working from home? Explain each briefly."
NODE_SIDES = {"node det, spec off": ("--spec", "off"), "node det, spec auto": ("--spec", "auto"),
              "node no-det, spec off": ("--no-deterministic", "--spec", "off"),
              "node no-det, spec auto": ("--no-deterministic", "--spec", "auto")}
SERVER_SIDES = {"llama-server, none": (), "llama-server, ngram-simple": ("--spec-type", "ngram-simple"),
                "llama-server, ngram-mod": ("--spec-type", "ngram-mod")}
CTX = 8192


def edit(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Rewrite this code with the function compute_total renamed to {name}. "
                                        f"Answer with the whole code only.\n\n```python\n{CODE}```"}]


def prompts(path: str) -> dict[str, list[int]]:
    from meshnode.text.tokenizer import Tokenizer

    tok = Tokenizer(path)
    render = lambda msgs: [t for s in tok.prompt_slices(tok.chat_prompt(msgs)) for t in s]  # noqa: E731
    out = {"code-edit": render(edit(NAMES[0])), "chat": render([{"role": "user", "content": CHAT}])}
    out |= {f"crowd{i}": render(edit(n)) for i, n in enumerate(NAMES)}
    tok.close()
    return out


def rate(times: list[float]) -> float:
    """Decode tokens a second: those that arrived after the first event (a node's event may carry several),
    over the time from the first to the last."""
    return sum(t > times[0] for t in times) / (times[-1] - times[0])


def node_side(path: str, threads: int, args: tuple, work: dict, n: int, crowd: bool) -> dict:
    out = {}
    with NodeProcess(path, "--threads", str(threads), "--ctx", str(CTX), "--log-level", "WARNING", *args) as node, \
            node.client(timeout_s=900) as c:
        c.generate("warm", tokens=[3, 4, 5], max_tokens=4, ignore_eos=True)
        for task in ("code-edit", "chat"):
            before = c.status()["telemetry"]["engine"]
            r = c.generate(task, tokens=work[task], max_tokens=n, ignore_eos=True)
            e = c.status()["telemetry"]["engine"]
            out[task] = {"tok_s": rate(r.token_times), "tokens": r.tokens,
                         "drafted": e["drafted_rows_total"] - before["drafted_rows_total"],
                         "accepted": e["drafts_served_total"] - before["drafts_served_total"]}
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
        for task in ("code-edit", "chat"):
            times, final = [], {}
            toks, _ = server.complete(work[task], n, on_token=times.append, final=final, cache_prompt=False)
            t = final.get("timings", {})
            out[task] = {"tok_s": rate(times), "tokens": toks, "drafted": t.get("draft_n", 0),
                         "accepted": t.get("draft_n_accepted", 0), "server_tok_s": t.get("predicted_per_second")}
    return out


def main(a) -> int:
    threads = a.threads or os.cpu_count()
    path = model_path(a)
    n = a.tokens if a.tokens != 32 else 256
    work = prompts(path)
    print(f"bench spec: {os.path.basename(path)}, one session alone, greedy, {n} new tokens; code-edit prompt "
          f"{len(work['code-edit'])} tokens, chat {len(work['chat'])}; threads {threads}, {a.rounds} rounds; "
          f"{llama_build()}", flush=True)
    node_sides, server_sides = dict(NODE_SIDES), dict(SERVER_SIDES)
    if a.draft_model:  # the model's draft (llama-server's -md) beside the lookup
        from meshnode.ops import realmodel

        draft = str(realmodel.real_model(a.draft_model)) if a.draft_model in realmodel.NAMES else a.draft_model
        node_sides["node det, draft model"] = ("--spec", "draft", "--draft-model", draft)
        node_sides["node det, auto + draft model"] = ("--spec", "auto", "--draft-model", draft)
        server_sides["llama-server, draft model"] = ("-md", draft, "--spec-type", "draft-simple")
    sides = list(node_sides) + (list(server_sides) if a.llama_server else [])
    if a.sides:
        sides = [s for s in sides if s in a.sides.split(";")]  # the names hold commas
    rounds = []
    for r in range(a.rounds):
        got = {}
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            if side in node_sides:
                got[side] = node_side(path, threads, node_sides[side], work, n, crowd=not a.sides)
            else:
                got[side] = server_side(a.llama_server, path, threads, server_sides[side], work, n)
            print(f"  ... {side} done", flush=True)
        rounds.append(got)
        for side in sides:
            line = "  ".join(f"{task} {got[side][task]['tok_s']:6.1f} tok/s"
                             + (f" (drafted {got[side][task]['drafted']}, accepted {got[side][task]['accepted']})"
                                if got[side][task].get("drafted") else "")
                             for task in ("code-edit", "chat"))
            cr = got[side].get("crowd")
            crowd = f"  crowd of 8 {cr['tok_s']:6.1f} tok/s (drafted {cr.get('drafted', 0)})" if cr else ""
            print(f"  round {r + 1} {side:<27} {line}{crowd}", flush=True)
    verdicts = summary(rounds, sides)
    for line in verdicts:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "new_tokens": n,
                       "prompt_tokens": {k: len(v) for k, v in work.items()}, "rounds": [
                           {s: {t: {k: v for k, v in f.items() if k != "tokens"} for t, f in side.items()}
                            for s, side in rd.items()} for rd in rounds], "verdicts": verdicts}, f, indent=1)
    return 0


def summary(rounds: list[dict], sides: list[str]) -> list[str]:
    """The ratios the issue's goals name, for the sides this run had."""
    med = lambda side, task: float(np.median([rd[side][task]["tok_s"] for rd in rounds]))  # noqa: E731
    ratio = lambda a, b, task: [rd[a][task]["tok_s"] / rd[b][task]["tok_s"] for rd in rounds]  # noqa: E731
    fmt = lambda xs: f"{np.median(xs):.2f}x (rounds {', '.join(f'{x:.2f}' for x in xs)})"  # noqa: E731
    same = lambda a, b, task: all(rd[a][task]["tokens"] == rd[b][task]["tokens"] for rd in rounds)  # noqa: E731
    tasks = ("code-edit", "chat")
    out = []
    pairs = [(f"node {m}, spec auto", f"node {m}, spec off") for m in ("det", "no-det")]
    pairs += [(f"node det, {d}", "node det, spec off") for d in ("draft model", "auto + draft model")]
    for on, off in pairs:
        if on not in sides or off not in sides:
            continue
        line = f"{on} / spec off: " + ", ".join(f"{t} {fmt(ratio(on, off, t))}" for t in tasks)
        if "crowd" in rounds[0][on]:
            line += f", crowd of 8 {fmt(ratio(on, off, 'crowd'))}"
        acc = [f"{t} {sum(rd[on][t]['accepted'] for rd in rounds)}/{sum(rd[on][t]['drafted'] for rd in rounds)}"
               for t in tasks]
        out.append(line + "; tokens identical to spec off: " + ", ".join(
            f"{t} {same(on, off, t)}" for t in (*tasks, *(["crowd"] if "crowd" in rounds[0][on] else []))) +
            "; drafts accepted " + ", ".join(acc))
    if "llama-server, none" in sides:
        best = max([s for s in ("llama-server, ngram-simple", "llama-server, ngram-mod") if s in sides],
                   key=lambda s: med(s, "code-edit"), default=None)
        for node in [s for s in ("node det, spec auto", "node no-det, spec auto") if s in sides]:
            if best:
                out.append(f"{node} / {best} (llama-server's best on code-edit): "
                           f"{fmt(ratio(node, best, 'code-edit'))} (goal >= 1.5x)")
            out.append(f"{node} / llama-server, none on chat: {fmt(ratio(node, 'llama-server, none', 'chat'))} "
                       "(goal >= 1.0x)")
        for s in [s for s in sides if s.startswith("llama-server")]:
            out.append(f"{s}: code-edit {med(s, 'code-edit'):.1f} tok/s, chat {med(s, 'chat'):.1f} tok/s; tokens "
                       f"identical to its own none: {all(same(s, 'llama-server, none', t) for t in tasks)}")
    return out
