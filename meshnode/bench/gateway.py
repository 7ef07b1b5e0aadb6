"""`meshnode bench gateway`: what the OpenAI HTTP gateway adds to the node, and the whole path beside
llama-server's own HTTP.

One node with its gateway child (`serve --http`); rounds whose order rotates:
- the same sessions (64 greedy tokens, EOS ignored) at concurrency 1 and 8 through the node's ZeroMQ
  client and through the gateway's streamed /v1/completions: aggregate tok/s, first token and the gap
  between tokens (p50, p99) as the client sees them, and the CPU each process spent per token (this
  client, the front, the gateway, the engine: on a 2-core host they all share the engine's cores);
- the 16-job mix (prompts 4-100 tokens, 32 new, concurrency 8) and `bench burst`'s burst (4 decoding, then
  4 prompts of 1,000 tokens) through the gateway and, given `--llama-server`, through llama-server's
  /v1/completions on the same model, threads, 8 slots and context.
HTTP is driven by the same streaming client code on both servers (aiohttp's client, one thread for all streams;
`bench burst`'s calls: http.client, one thread a stream, as burst runs them).
"""
from __future__ import annotations

import http.client
import json
import os
import time

import numpy as np

from meshnode.bench import llama_build, model_path, streams
from meshnode.bench.burst import CTX, burst_with
from meshnode.bench.llama_server import Stop
from meshnode.bench.sweep import make_jobs
from meshnode.dev.nodeproc import NodeProcess

NEW = 64


def stream(port: int, body: dict, on_token=None) -> list[float]:
    """One streamed /v1/completions; the arrival time of each chunk that carries text. `on_token(time)`
    runs at each and may raise Stop to hang up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    times = []
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        for line in resp:
            if line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: ") and json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.monotonic())
                if on_token:
                    on_token(times[-1])
    except Stop:
        pass
    finally:
        conn.close()
    return times


def over_http(port: int, jobs: list[dict], at_once: int) -> dict:
    """Jobs ({tokens, max_tokens}) `at_once` at a time over HTTP: per job (start, chunk times).

    One thread and one event loop for every stream (aiohttp's client), as the ZeroMQ side reads every
    session on one socket in one thread: one Python thread a stream would add its own GIL hand-offs to
    the HTTP side's gaps (measured: +9.8 ms p99 at 8 streams against this client's +5.9, same run)."""
    import asyncio

    import aiohttp

    out: dict[int, tuple[float, list[float], int]] = {}

    async def one(session, body: dict) -> tuple[list[float], int]:
        """The arrival of each chunk that carries text, and the tokens generated (the final usage chunk's: a
        chunk may carry several tokens, the node's multi-step ticks' or a held-back UTF-8 character's)."""
        times, n = [], 0
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    break
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.monotonic())
        if not n:
            raise RuntimeError("the stream ended without its usage (stream_options.include_usage)")
        return times, n

    async def run():
        todo = list(enumerate(jobs))
        # a connection a request, on both sides: llama-server closed a pooled connection between two of the mix's
        # requests and the next one's write failed ("Cannot write to closing transport"), ending the run
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                         connector=aiohttp.TCPConnector(force_close=True)) as session:
            async def worker():
                while todo:
                    i, job = todo.pop(0)
                    t0 = time.monotonic()
                    out[i] = (t0, *await one(session, {"prompt": job["tokens"], "max_tokens": job["max_tokens"],
                                                       "temperature": 0, "ignore_eos": True}))
            await asyncio.gather(*(worker() for _ in range(at_once)))

    asyncio.run(run())
    return out


def over_zmq(c, jobs: list[dict], at_once: int, tag: str) -> dict:
    out: dict[int, tuple[float, list[float], int]] = {}
    pending = list(enumerate(jobs))
    live: dict[str, tuple[int, float]] = {}
    while pending or live:
        while pending and len(live) < at_once:
            i, job = pending.pop(0)
            sid = f"{tag}-{i}"
            live[sid] = (i, time.monotonic())
            c.submit(sid, tokens=job["tokens"], max_tokens=job["max_tokens"], ignore_eos=True)
        ev = c.wait_for(lambda e: e.get("id") in live, 600)
        i, t0 = live[ev["id"]]
        if ev["event"] == "admitted":
            continue
        if ev["event"] == "tokens" and ev["text"]:
            out.setdefault(i, (t0, [], 0))[1].append(time.monotonic())
        elif ev["event"] != "tokens":
            assert ev["event"] == "done", ev
            del live[ev["id"]]
            out[i] = (*out.get(i, (t0, []))[:2], len(ev["tokens"]))
    return out


def figures(res: dict) -> dict:
    """`res`: each session's (submit time, arrival times of its chunks with text, tokens generated): tok/s
    counts tokens, the gaps and first-token delays count chunks (what a client waits between two)."""
    return streams([t0 for t0, _, _ in res.values()], [ts for _, ts, _ in res.values()],
                   sum(n for _, _, n in res.values()))


def processes(node_pid: int) -> dict:
    """The processes whose CPU a side spends: this one (the client), the node's front, its gateway child
    and its engine."""
    import psutil

    front = psutil.Process(node_pid)
    out = {"client": psutil.Process(), "front": front}
    for child in front.children():
        out["gateway" if "gateway" in " ".join(child.cmdline()) else "engine"] = child
    return out


def with_cpu(procs: dict, side) -> dict:
    """Run a side; add each process's CPU time per token it streamed (user + system, ms)."""
    def cpu():
        return {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
    before = cpu()
    got = side()
    after = cpu()
    return {**got, **{f"cpu_ms_per_token_{k}": (after[k] - before[k]) * 1e3 / got["tokens"] for k in procs}}


def _verdict(runs: dict, med: dict, procs, rounds: int) -> list[str]:
    """The side-by-side lines: gateway vs ZeroMQ paired by round, and the mix and burst vs llama-server."""
    verdict = [f"medians of {rounds} rounds"]
    for k in (1, 8):  # paired within each round: the machine's state drifts between rounds
        if f"c{k} zmq" not in runs or f"c{k} http" not in runs:
            continue
        pairs = list(zip(runs[f"c{k} zmq"], runs[f"c{k} http"]))
        cost = sorted(1 - h["tok_s"] / z["tok_s"] for z, h in pairs)
        p99 = sorted(h["gap_p99_ms"] - z["gap_p99_ms"] for z, h in pairs)
        first = sorted(h["ttft_p50_ms"] - z["ttft_p50_ms"] for z, h in pairs)
        verdict.append(f"concurrency {k}, paired by round: the gateway costs {np.median(cost):+.1%} throughput "
                       f"(rounds {', '.join(f'{x:+.1%}' for x in cost)}), {np.median(p99):+.1f} ms p99 between tokens "
                       f"(rounds {', '.join(f'{x:+.1f}' for x in p99)}), {np.median(first):+.1f} ms first token p50")
        z, h = med[f"c{k} zmq"], med[f"c{k} http"]
        verdict.append(f"concurrency {k}, CPU ms per token (medians), zmq side / http side: " + ", ".join(
            f"{p} {z[f'cpu_ms_per_token_{p}']:.3f} / {h[f'cpu_ms_per_token_{p}']:.3f}" for p in procs))
    if "mix llama-server" in med and "mix gateway" in med:
        g, s = med["mix gateway"], med["mix llama-server"]
        verdict.append(f"16-job mix over HTTP: gateway + node {g['tok_s']:.1f} tok/s vs llama-server {s['tok_s']:.1f} "
                       f"({g['tok_s'] / s['tok_s']:.2f}x); gap p99 {g['gap_p99_ms']:.1f} vs {s['gap_p99_ms']:.1f} ms")
    if "burst llama-server" in med and "burst gateway" in med:
        g, s = med["burst gateway"], med["burst llama-server"]
        verdict.append(f"burst over HTTP: worst in-flight gap {g['burst_itl_ms_max']:.0f} vs "
                       f"{s['burst_itl_ms_max']:.0f} ms, last burst first token {g['burst_ttft_ms_max']:.0f} vs "
                       f"{s['burst_ttft_ms_max']:.0f} ms, steady gap p99 {g['steady_itl_ms_p99']:.1f} vs "
                       f"{s['steady_itl_ms_p99']:.1f} ms (gateway + node vs llama-server)")
    return verdict


def main(a) -> int:
    from ipc.transport import free_tcp_port

    path = model_path(a)
    threads = a.threads or os.cpu_count()
    print(f"bench gateway: {os.path.basename(path)}, threads {threads}, {a.rounds} rounds; {llama_build()}", flush=True)

    def salted(jobs: list[dict], r: int) -> list[dict]:  # new prompts every round: no side reuses a cached one
        return [{**j, "tokens": [3 + (t - 3 + r * 101) % 500 for t in j["tokens"]]} for j in jobs]

    new = max(NEW, a.tokens)  # longer streams (`--tokens`) measure the pairs' small difference over more ticks
    same = {c: [{"tokens": [3 + (i * 37 + k) % 500 for k in range(16)], "max_tokens": new} for i in range(c)] for c in (1, 8)}
    mix = make_jobs(16, [4, 16, 32, 64, 100], 32)
    runs: dict[str, list[dict]] = {}
    port = free_tcp_port()

    def llama_server(work):
        """llama-server for one side only, started before and stopped after it (no idle peer beside the node)."""
        from meshnode.bench.llama_server import LlamaServer

        with LlamaServer(a.llama_server, path, threads, slots=8, ctx=CTX) as server:
            return work(server.port)

    with NodeProcess(path, "--threads", str(threads), "--log-level", "WARNING", "--max-active", "8", "--ctx", str(CTX),
                     "--http", f"127.0.0.1:{port}") as node, node.client(timeout_s=600) as c:
        _wait_http(port)
        procs = processes(node.proc.pid)
        for r in range(a.rounds):
            sides = {f"c{k} zmq": (lambda k=k, r=r: with_cpu(procs, lambda: figures(over_zmq(c, salted(same[k], r), k,
                                                                                               f"r{r}c{k}"))))
                     for k in (1, 8)}
            sides.update({f"c{k} http": (lambda k=k, r=r: with_cpu(procs, lambda: figures(over_http(port, salted(same[k], r),
                                                                                                    k))))
                          for k in (1, 8)})
            sides["mix gateway"] = lambda r=r: figures(over_http(port, salted(mix, r), 8))
            sides["burst gateway"] = lambda r=r: burst_with(_completer(port), r + 1)
            if a.llama_server:
                sides["mix llama-server"] = lambda r=r: llama_server(lambda p: figures(over_http(p, salted(mix, r), 8)))
                sides["burst llama-server"] = lambda r=r: llama_server(lambda p: burst_with(_completer(p), r + 1,
                                                                                                 one_token_chunks=True))
            names = [n for n in sides if not a.sides or n in a.sides.split(",")]
            for name in names[r % len(names):] + names[:r % len(names)]:
                runs.setdefault(name, []).append(sides[name]())
                print(f"  round {r + 1} {name:<18} " + "  ".join(f"{k} {v:.1f}" for k, v in runs[name][-1].items()),
                      flush=True)
    med = {name: {k: float(np.median([f[k] for f in fs])) for k in fs[0]} for name, fs in runs.items()}
    verdict = _verdict(runs, med, procs, a.rounds)
    for line in verdict:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"build": llama_build(), "tokens_per_session": new, "runs": runs, "median": med, "verdict": verdict},
                      f, indent=1)
    return 0


def _completer(port: int):
    """`bench burst`'s client call, over streamed /v1/completions."""
    def complete(prompt, n, on_token):
        stream(port, {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}, on_token)
    return complete


def _wait_http(port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the gateway did not come up")
