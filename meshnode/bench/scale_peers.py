"""`meshnode bench scale --llama-server PATH`: the node beside llama-server as sessions and depth grow.

- concurrency: N sessions (N = 1 .. 64) submitted together, each a 32-token prompt and 64 greedy tokens
  past EOS, through a fresh node (`--max-active N`, 512 cells a session) and through llama-server with
  `-np N` and the same context: aggregate tok/s (all tokens over the span from the first submit to the
  last token), the gap between a session's tokens (p50, p99) and the first-token delay (p50, p99);
- depth: one session whose prompt is 512, 2k, 8k or 16k tokens, then 64 tokens: prefill tok/s (prompt
  over first-token delay) and decode ms a token. Needs a model with that much trained context (the
  bench-long preset).
Each round runs both servers at every level, their order alternating, on the same model and threads.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from meshnode.bench import streams
from meshnode.bench.llama_server import LlamaServer
from meshnode.dev.nodeproc import NodeProcess

LEVELS = (1, 2, 4, 8, 16, 32, 64)
DEPTHS = (512, 2048, 8192, 16384)
PROMPT, NEW, CELLS = 32, 64, 512


def prompt(i: int, n: int, salt: int) -> list[int]:
    return [3 + (i * 31 + k * 7 + salt * 101) % 500 for k in range(n)]


def node_side(path: str, threads: int, prompts: list[list[int]], ctx: int, extra: tuple[str, ...] = ()) -> dict:
    n = len(prompts)
    with NodeProcess(path, "--max-active", str(n), "--n-seq-max", str(n), "--ctx", str(ctx), "--threads", str(threads),
                     "--log-level", "WARNING", *extra) as node, node.client(timeout_s=1200) as c:
        c.generate("warm", tokens=[3, 4, 5], max_tokens=2)
        starts = []
        for i, p in enumerate(prompts):
            starts.append(time.monotonic())
            c.submit(f"s{i}", tokens=p, max_tokens=NEW, ignore_eos=True)
        res = c.collect([f"s{i}" for i in range(n)])
    for i in range(n):
        if len(res[f"s{i}"].token_times) < NEW:
            raise RuntimeError(f"the node ended session s{i} early: {res[f's{i}'].done}")
    return streams(starts, [res[f"s{i}"].token_times for i in range(n)])


def server_side(binary: str, path: str, threads: int, prompts: list[list[int]], ctx: int) -> dict:
    n = len(prompts)
    starts, times, finals = [0.0] * n, [[] for _ in range(n)], [{} for _ in range(n)]
    with LlamaServer(binary, path, threads, slots=n, ctx=ctx) as server:
        def one(i: int) -> None:  # its stream holds back tokens that end inside a UTF-8 character: count its own
            starts[i] = time.monotonic()
            server.complete(prompts[i], NEW, on_token=times[i].append, final=finals[i])
        workers = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    made = [f.get("tokens_predicted", 0) for f in finals]
    if min(made) < NEW:
        raise RuntimeError(f"llama-server generated {min(made)} tokens for a request, not {NEW}")
    return streams(starts, times, sum(made))


def depth_figures(f: dict, depth: int) -> dict:
    """One session: its prefill rate and decode time a token, from streams() of it alone."""
    return {"prefill_tok_s": depth / (f["ttft_p50_ms"] / 1e3), "decode_ms_per_token": f["gap_p50_ms"]}


def side_by_side(sides: dict, flip: bool) -> dict:
    """Each side's figures, run in the order given or, when `flip`, the other way round (so the machine's
    drift favours neither); the result in the order they ran."""
    names = list(sides)[::-1] if flip else list(sides)
    return {name: sides[name]() for name in names}


def run(a, path: str, threads: int, deep_path: str | None, log=print, levels=LEVELS,
        extra: tuple[str, ...] = ()) -> dict:
    """Every round: each concurrency level, then each depth, node and llama-server side by side. `extra`: more
    `meshnode serve` arguments for the node (e.g. --no-deterministic)."""
    out: dict = {"concurrency": {}, "depth": {}, "node_args": list(extra)}
    for r in range(a.rounds):
        for k, n in enumerate(levels):
            prompts = [prompt(i, PROMPT, r) for i in range(n)]
            got = side_by_side({"node": lambda: node_side(path, threads, prompts, n * CELLS, extra),
                                "llama-server": lambda: server_side(a.llama_server, path, threads, prompts, n * CELLS)},
                               flip=(r + k) % 2 == 1)
            out["concurrency"].setdefault(str(n), []).append(got)
            log(f"  round {r + 1} concurrency {n:>2}: " + "; ".join(
                f"{name} {f['tok_s']:6.1f} tok/s gap p50 {f['gap_p50_ms']:6.1f} p99 {f['gap_p99_ms']:6.1f} ms first "
                f"p50 {f['ttft_p50_ms']:7.0f} p99 {f['ttft_p99_ms']:7.0f} ms" for name, f in got.items()), flush=True)
        if deep_path is None:
            continue
        for k, d in enumerate(DEPTHS):
            p = [prompt(0, d, r)]
            got = side_by_side({"node": lambda: depth_figures(node_side(deep_path, threads, p, d + 2 * NEW, extra), d),
                                "llama-server": lambda: depth_figures(
                                    server_side(a.llama_server, deep_path, threads, p, d + 2 * NEW), d)},
                               flip=(r + k) % 2 == 1)
            out["depth"].setdefault(str(d), []).append(got)
            log(f"  round {r + 1} depth {d:>5}: " + "; ".join(
                f"{name} prefill {f['prefill_tok_s']:6.1f} tok/s decode {f['decode_ms_per_token']:6.1f} ms/token"
                for name, f in got.items()), flush=True)
    return out


def verdicts(out: dict) -> list[str]:
    """Per level: the node's throughput over llama-server's and its gap p99 over theirs, every round."""
    lines = []
    for n, rounds in out["concurrency"].items():
        tput = [r["node"]["tok_s"] / r["llama-server"]["tok_s"] for r in rounds]
        p99 = [r["node"]["gap_p99_ms"] / r["llama-server"]["gap_p99_ms"] for r in rounds]
        lines.append(f"concurrency {n:>2}: node / llama-server throughput {np.median(tput):.2f} (rounds "
                     f"{', '.join(f'{x:.2f}' for x in tput)}), gap p99 {np.median(p99):.2f} (rounds "
                     f"{', '.join(f'{x:.2f}' for x in p99)}); goals >= 1, <= 1: met in {sum(x >= 1 for x in tput)} and "
                     f"{sum(x <= 1 for x in p99)} of {len(rounds)} rounds")
    for d, rounds in out["depth"].items():
        pre = [r["node"]["prefill_tok_s"] / r["llama-server"]["prefill_tok_s"] for r in rounds]
        dec = [r["llama-server"]["decode_ms_per_token"] / r["node"]["decode_ms_per_token"] for r in rounds]
        lines.append(f"depth {d:>5}: node / llama-server prefill rate {np.median(pre):.2f} (rounds "
                     f"{', '.join(f'{x:.2f}' for x in pre)}), decode rate {np.median(dec):.2f} (rounds "
                     f"{', '.join(f'{x:.2f}' for x in dec)})")
    return lines
