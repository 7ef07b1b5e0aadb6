"""`meshnode gateway`: the OpenAI HTTP API (aiohttp) in front of one node, as a client of it.

A streamed request waits for its admission before it answers, so the node's rejections become status
codes (429 with Retry-After, 503, 400) and never a broken stream. An HTTP client that disconnects
cancels its session (aiohttp cancels the handler; the node gets `cancel`). Non-loopback addresses need
API keys (`Authorization: Bearer`, one key per line of `--api-key-file`) or `--insecure`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
import urllib.request

from aiohttp import web

from ipc import protocol as P
from ipc.transport import api_keys
from meshnode.core.endpoints import host_port
from meshnode.gateway import api, deadline
from meshnode.gateway.options import refusal
from meshnode.gateway.upstream import Upstream

log = logging.getLogger("meshnode.gateway")
BODY_S = 60.0  # a request's body must arrive within this long of its headers (408 after)


class Gateway:
    def __init__(self, up: Upstream, model: str, piece=None, keys: set[bytes] | None = None, metrics_from: str = "",
                 recipe: str = "", tool_format: str = "generic"):
        self.up, self.model, self.piece, self.keys, self.metrics_from = up, model, piece, keys or set(), metrics_from
        self.recipe, self.tool_format = recipe, tool_format

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_deadline, self._auth], client_max_size=P.MAX_TEXT_BYTES + (1 << 20))
        app.add_routes([web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.metrics)])
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.keys and request.path != "/health":
            # as bytes: compare_digest refuses a str that is not ASCII, and a header may hold anything
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not (given.startswith(b"Bearer ") and any(secrets.compare_digest(given[7:], k) for k in self.keys)):
                return _error(api.ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)",
                                           code="invalid_api_key"))
        try:
            return await handler(request)
        except api.ApiError as e:
            return _error(e)

    async def chat(self, request: web.Request):
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request):
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool):
        try:
            body = await asyncio.wait_for(request.json(), BODY_S)
        except asyncio.TimeoutError:
            raise api.ApiError(408, f"the request body did not arrive within {BODY_S:g} s") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise api.ApiError(400, "the request body is not JSON") from None
        except RecursionError:
            raise api.ApiError(400, "the request body nests deeper than this server reads") from None
        req = api.parse(body, chat, self.model, lambda: secrets.token_hex(12), self.tool_format)
        if req.top_logprobs is not None and self.piece is None:
            raise api.ApiError(400, "logprobs need the model's vocabulary, which this gateway cannot read (run it "
                                    "where the model file is, or give --model)", param="logprobs")
        sid = req.submit.id
        try:
            q = self.up.open(req.submit)
        except OverflowError as e:
            raise api.ApiError(413, f"{e}: send a shorter prompt or schema") from None
        except ValueError as e:
            raise api.ApiError(400, str(e)) from None
        ended = False
        try:
            first = await q.get()
            if first["event"] != "admitted":
                ended = True
                raise api.rejection(first)
            answer = api.Answer(req, self.piece, self.recipe)
            resp = await self._stream_start(request) if req.stream else None
            ev = await q.get()
            while ev["event"] == "tokens":
                chunks, ev = answer.tokens(ev), None
                while not q.empty():  # the client is behind: what waits goes in one write
                    ev = q.get_nowait()
                    if ev["event"] != "tokens":
                        break
                    chunks, ev = chunks + answer.tokens(ev), None
                if resp is not None and chunks:
                    await resp.write(_sse(chunks))
                if ev is None:
                    ev = await q.get()
            ended = True
            err = api.rejection(ev) if ev["event"] == "error" else api.finish_error(ev)
            if resp is None:
                if err:
                    raise err
                return web.json_response(answer.end(ev)[0])
            await resp.write(_sse([err.body()] if err else answer.end(ev)) + b"data: [DONE]\n\n")
            return resp
        finally:
            if ended:
                self.up.finished(sid)
            else:  # the client went away (the handler was cancelled, or a write failed)
                self.up.abandon(sid)

    @staticmethod
    async def _stream_start(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    async def models(self, request: web.Request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "meshnode"}]})

    async def health(self, request: web.Request):
        try:
            st = await self.up.ask(P.Status(), timeout_s=2.0)
        except (asyncio.TimeoutError, ConnectionError):
            return web.json_response({"status": "error", "detail": "the node does not answer"}, status=503)
        healthy = st.get("node", {}).get("healthy", False)
        return web.json_response({"status": "ok" if healthy else "unhealthy"}, status=200 if healthy else 503)

    async def metrics(self, request: web.Request):
        if not self.metrics_from:
            raise api.ApiError(404, "this gateway was not given the node's /metrics (--metrics-from)")
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(self.metrics_from, timeout=5).read())
        return web.Response(body=text, content_type="text/plain", charset="utf-8")


@web.middleware
async def _deadline(request: web.Request, handler):
    """The request's headers are in: its connection's header deadline stops until the answer is written."""
    wrapper = deadline.wrapper_of(request.transport)
    if wrapper is not None:
        wrapper.started()
    try:
        return await handler(request)
    finally:
        if wrapper is not None:
            wrapper.handled()


def _sse(chunks: list[dict]) -> bytes:
    """Server-sent events for the chunks, written at once: one wake-up of the client, one syscall."""
    return b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks)


def _error(e: api.ApiError) -> web.Response:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return web.json_response(e.body(), status=e.status, headers=headers)


async def _serve(a, endpoint: str, keys: set[bytes]) -> None:
    from ipc.transport import client_curve

    up = Upstream(endpoint, **client_curve(a.curve_server_key, a.curve_client_cert))
    await up.start()
    while True:  # a gateway may start before its node: wait for it, saying so
        try:
            node = (await up.ask(P.Status(), timeout_s=10.0))["node"]
            break
        except (asyncio.TimeoutError, ConnectionError):
            log.warning("no answer from the node at %s yet; still trying", endpoint)
    path = a.model or node["model"]
    piece = None
    if path and os.path.exists(path):
        from meshnode.text.tokenizer import Tokenizer

        piece = Tokenizer(path).piece
    gw = Gateway(up, os.path.basename(node["model"]), piece, keys, a.metrics_from or "", node.get("recipe", ""),
                 node.get("tool_format", "generic"))
    runner = web.AppRunner(gw.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    host, port = host_port(a.listen)
    server = await deadline.serve(runner, host, port, a.header_timeout_s)
    log.info("meshnode gateway ready: http://%s/v1 node=%s model=%s logprobs=%s keys=%d tools=%s", a.listen,
             endpoint, gw.model, "yes" if piece else "no (no vocab)", len(keys), gw.tool_format)
    stop = asyncio.Event()
    for sig in ("SIGTERM", "SIGINT"):
        asyncio.get_running_loop().add_signal_handler(getattr(__import__("signal"), sig), stop.set)
    await stop.wait()
    server.close()
    await runner.cleanup()
    await up.close()


def main(a) -> int:
    from ipc.transport import default_listen

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        keys = api_keys(a.api_key_file)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"meshnode gateway: {e}", file=__import__("sys").stderr)
        return 2
    why = refusal(a.listen, keys, a.insecure)
    if why:
        print(f"meshnode gateway: {why}", file=__import__("sys").stderr)
        return 2
    asyncio.run(_serve(a, a.node or default_listen(), keys))
    return 0
