#!/usr/bin/env python
"""Which HTTP stack the gateway uses: aiohttp beside Starlette on uvicorn, measured on the gateway's own
work (server-sent events, one small JSON chunk per token, and small JSON answers), in one run.

  pip install starlette uvicorn   # only for this comparison; the gateway runs on aiohttp
  python tools/http_stacks.py [--rounds 3] [--json evidence/http-stacks.json]

Each stack serves from its own process; one client process (httpx) drives both in turn, the order
rotating per round: 8 streams at once of 256 chunks each, and 400 JSON requests 8 at a time. Reported:
the server process's CPU time per chunk and per request (psutil, what the gateway would spend beside
the node), and the client-side wall time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

CHUNK = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}]}
STREAMS, CHUNKS, REQUESTS, AT_ONCE = 8, 256, 400, 8


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def sse(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        data = b"data: " + json.dumps(CHUNK).encode() + b"\n\n"
        for _ in range(int(request.query["n"])):
            await resp.write(data)
            await asyncio.sleep(0)  # the gateway waits on the node between tokens
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def echo(request):
        return web.json_response({**CHUNK, "echo": await request.json()})

    app = web.Application()
    app.add_routes([web.get("/sse", sse), web.post("/echo", echo)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_starlette(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def sse(request):
        data = b"data: " + json.dumps(CHUNK).encode() + b"\n\n"

        async def gen():
            for _ in range(int(request.query_params["n"])):
                yield data
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def echo(request):
        return JSONResponse({**CHUNK, "echo": await request.json()})

    app = Starlette(routes=[Route("/sse", sse), Route("/echo", echo, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def streams(port: int) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        async def one_stream():
            got = 0
            async with client.stream("GET", f"http://127.0.0.1:{port}/sse", params={"n": CHUNKS}) as r:
                async for line in r.aiter_lines():
                    got += line.startswith("data: {")
            assert got == CHUNKS, got
        await asyncio.gather(*(one_stream() for _ in range(STREAMS)))


async def requests(port: int) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        async def some(k):
            for i in range(k):
                r = await client.post(f"http://127.0.0.1:{port}/echo", json={"i": i})
                assert r.status_code == 200
        await asyncio.gather(*(some(REQUESTS // AT_ONCE) for _ in range(AT_ONCE)))


def one(stack: str) -> dict:
    import psutil

    from ipc.transport import free_tcp_port

    port = free_tcp_port()
    proc = subprocess.Popen([sys.executable, __file__, "serve", stack, str(port)])
    try:
        import httpx

        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(f"http://127.0.0.1:{port}/echo", json={}, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        ps = psutil.Process(proc.pid)
        out = {}
        for name, phase, n in (("chunk", streams, STREAMS * CHUNKS), ("request", requests, REQUESTS)):
            c0, t0 = ps.cpu_times(), time.perf_counter()
            asyncio.run(phase(port))
            c1, t1 = ps.cpu_times(), time.perf_counter()
            out[f"cpu_us_per_{name}"] = ((c1.user + c1.system) - (c0.user + c0.system)) / n * 1e6
            out[f"wall_us_per_{name}"] = (t1 - t0) / n * 1e6
    finally:
        proc.terminate()
        proc.wait(10)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        {"aiohttp": serve_aiohttp, "starlette": serve_starlette}[sys.argv[2]](int(sys.argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args()
    import importlib.metadata as md

    versions = {k: md.version(k) for k in ("aiohttp", "starlette", "uvicorn", "httpx")}
    print(f"http stacks: {STREAMS} streams x {CHUNKS} chunks, {REQUESTS} JSON requests {AT_ONCE} at a time, "
          f"{a.rounds} rounds; {versions}; {os.cpu_count()} CPUs", flush=True)
    stacks = ["aiohttp", "starlette"]
    runs: dict[str, list] = {s: [] for s in stacks}
    for r in range(a.rounds):
        for s in stacks[r % 2:] + stacks[:r % 2]:
            runs[s].append(one(s))
            m = runs[s][-1]
            print(f"  round {r + 1} {s:<10} server CPU {m['cpu_us_per_chunk']:6.1f} us a chunk, {m['cpu_us_per_request']:6.1f} "
                  f"us a request; wall {m['wall_us_per_chunk']:6.1f} us a chunk, {m['wall_us_per_request']:6.1f} us a request",
                  flush=True)
    med = {s: {k: sorted(x[k] for x in rs)[len(rs) // 2] for k in rs[0]} for s, rs in runs.items()}
    for s, m in med.items():
        print(f"median {s:<10} {m['cpu_us_per_chunk']:.1f} us CPU a chunk, {m['cpu_us_per_request']:.1f} us a request")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"versions": versions, "runs": runs, "median": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
