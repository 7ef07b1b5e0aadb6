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
from meshnode.core.endpoints import hosts_port
from meshnode.core.types import model_names, sampling_defaults
from meshnode.gateway import api, deadline, embeddings, messages, responses
from meshnode.gateway.cors import Cors
from meshnode.gateway.options import refusal
from meshnode.gateway.upstream import FINAL, Upstream

log = logging.getLogger("meshnode.gateway")
EMBED_WINDOW = 8  # inputs of one /v1/embeddings request in the node at once: the node's queue takes turns between
# clients, but the gateway is one client for all its users (256 inputs sent at once held the queue for 63 s)
BODY_S = 60.0  # a request's body must arrive within this long of its headers (408 after)


class Gateway:
    def __init__(self, up: Upstream, model: str, piece=None, keys: set[bytes] | None = None, metrics_from: str = "",
                 recipe: str = "", tool_format: str = "generic", cors: Cors | None = None, defaults: dict | None = None,
                 aliases: list[str] = (), tags: list[str] = (), metrics: bool = True, reasoning_format: str = "auto"):
        self.up, self.model, self.piece, self.keys, self.metrics_from = up, model, piece, keys or set(), metrics_from
        self.aliases, self.tags, self.serves_metrics = list(aliases) or [model], list(tags), metrics
        self.reasoning_format = reasoning_format
        self.recipe, self.tool_format, self.cors = recipe, tool_format, cors or Cors()
        self.defaults = defaults or {}  # sampling options a request leaves out (--sampling-defaults)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_deadline, self.cors.preflight, self._auth],
                              client_max_size=P.MAX_TEXT_BYTES + (1 << 20))
        routes = [web.post("/chat/completions", self.chat), web.post("/completions", self.completions),
                  web.post("/responses", self.responses), web.post("/embeddings", self.embeddings),
                  web.post("/messages", self.messages), web.post("/messages/count_tokens", self.count_tokens),
                  web.get("/models", self.models)]
        # OpenAI's paths under /v1, and without it as llama-server and vLLM's clients also call them
        app.add_routes([*routes, *(web.route(r.method, "/v1" + r.path, r.handler) for r in routes),
                        web.get("/health", self.health), web.get("/v1/health", self.health),
                        web.get("/metrics", self.metrics)])
        app.on_response_prepare.append(self.cors.headers)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        anthropic = request.path.rstrip("/").endswith(("/messages", "/messages/count_tokens"))
        if self.keys and request.path not in ("/health", "/v1/health"):
            # as bytes: compare_digest refuses a str that is not ASCII, and a header may hold anything
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            key = given[7:] if given.startswith(b"Bearer ") else None
            if key is None and "x-api-key" in request.headers:  # Anthropic's clients send their key so
                key = request.headers["x-api-key"].encode("utf-8", "surrogateescape")
            if key is None or not any(secrets.compare_digest(key, k) for k in self.keys):
                err = api.ApiError(401, "a valid API key is needed (Authorization: Bearer KEY, or x-api-key: KEY)",
                                   code="invalid_api_key")
                return web.json_response(messages.error_body(err), status=401) if anthropic else _error(err)
        try:
            return await handler(request)
        except api.ApiError as e:
            return web.json_response(messages.error_body(e), status=e.status) if anthropic else _error(e)

    async def chat(self, request: web.Request):
        return await self._generate(request, self._parse(await _body(request), chat=True))

    async def completions(self, request: web.Request):
        return await self._generate(request, self._parse(await _body(request), chat=False))

    async def responses(self, request: web.Request):
        """OpenAI's Responses API: a chat in other clothes (gateway/responses.py), stateless."""
        body = await _body(request)
        req = self._parse(responses.to_chat(body), chat=True)
        return await self._generate(request, req, lambda i: responses.ResponseAnswer(req, body, self.recipe, self.piece))

    async def messages(self, request: web.Request):
        """Anthropic's Messages API: a chat in other clothes (gateway/messages.py); its errors in its shape."""
        chat = messages.to_chat(await _body(request))
        req = self._parse(chat, chat=True)
        return await self._generate(request, req, lambda i: messages.MessagesAnswer(req, self.piece))

    async def count_tokens(self, request: web.Request):
        """Anthropic's count_tokens: the request's input as the node renders and tokenizes it, nothing generated
        (its max_tokens, which a count need not send, does not count)."""
        body = await _body(request)
        chat = messages.to_chat({"max_tokens": 1, **body} if isinstance(body, dict) else body)
        submit = self._parse(chat, chat=True).submit
        open_ = {}
        try:
            self._open([P.Count(submit)], open_)
            ev = await open_[0][1].get()
        finally:
            if open_:
                self.up.finished(submit.id)
        if ev["event"] != "counted":
            raise api.rejection(ev)
        return web.json_response({"input_tokens": ev["prompt_tokens"]})

    def _parse(self, body, chat: bool) -> api.Request:
        return api.parse(body, chat, self.model, lambda: secrets.token_hex(12), self.tool_format, self.defaults,
                         self.reasoning_format)

    async def _generate(self, request: web.Request, req: api.Request, answer=None):
        """`answer(i)`: choice i's answer builder (api.Answer where not given)."""
        if req.top_logprobs is not None and self.piece is None:
            raise api.ApiError(400, "logprobs need the model's vocabulary, which this gateway cannot read (run it "
                                    "where the model file is, or give --model)", param="logprobs")
        open_, admitted = {}, {}
        try:
            self._open(req.submits(), open_)
            for i, (sid, q) in open_.items():  # every choice admitted before a byte of the answer
                admitted[i] = first = await q.get()
                if first["event"] != "admitted":
                    self.up.finished(sid)
                    del open_[i]
                    raise api.rejection(first)
            return await self._answer(request, req, open_, admitted,
                                      answer or (lambda i: api.Answer(req, self.piece, self.recipe, i)))
        finally:
            for sid, _ in open_.values():  # the client went away, or a sibling choice was refused
                self.up.abandon(sid)

    async def embeddings(self, request: web.Request):
        """Each input an embedding session of the node (batched beside generation by its scheduler), the
        vectors in the inputs' order."""
        submits, enc = embeddings.parse(await _body(request), lambda: secrets.token_hex(12))
        open_, vectors, tokens = {}, {}, 0
        try:
            for i in range(len(submits)):  # at most EMBED_WINDOW inputs in the node at once: the rest wait here
                self._open(submits, open_, range(i, min(i + EMBED_WINDOW, len(submits))))
                sid, q = open_[i]
                ev = await q.get()
                while ev["event"] in ("admitted", "embedding"):
                    if ev["event"] == "embedding":
                        vectors[i], tokens = ev["embedding"], tokens + ev["prompt_tokens"]
                    ev = await q.get()
                self.up.finished(sid)
                del open_[i]
                if ev["event"] != "done" or i not in vectors:
                    raise api.rejection(ev) if ev["event"] != "done" else (
                        api.finish_error(ev) or api.ApiError(500, "the node ended the embedding without a vector"))
        finally:
            for sid, _ in open_.values():
                self.up.abandon(sid)
        return web.json_response(embeddings.answer([vectors[i] for i in range(len(submits))], tokens,
                                                       self.model, enc))

    def _open(self, submits: list, open_: dict, which: range | None = None) -> None:
        """Each submit (of `which`, those not opened yet) sent as a session of the node, into `open_` (i -> (id, its
        events' queue)) as it goes, so the caller abandons what opened before one could not (413 too large, 400
        not encodable)."""
        for i in which if which is not None else range(len(submits)):
            if i in open_:
                continue
            submit = submits[i]
            try:
                open_[i] = (submit.id, self.up.open(submit))
            except OverflowError as e:
                raise api.ApiError(413, f"{e}: send a shorter prompt or schema") from None
            except ValueError as e:
                raise api.ApiError(400, str(e)) from None

    async def _answer(self, request: web.Request, req: api.Request, open_: dict, admitted: dict,
                      answer) -> web.StreamResponse:
        """The admitted choices' events, as they come, into one answer: stream chunks with each choice's index,
        or one response with every choice (usage: the prompt once, every choice's completion)."""
        answers = {i: answer(i) for i in open_}
        for i, a in answers.items():
            a.admitted(admitted[i])
        first = answers[0]
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(i, q, merged)) for i, (_, q) in open_.items()]
        resp = await self._stream_start(request) if req.stream else None
        opening = first.start() if resp is not None else []
        if opening:
            await resp.write(first.frame(opening))
        ends: dict[int, dict] = {}
        try:
            while len(ends) < len(answers):
                batch = [await merged.get()]
                while not merged.empty():  # the client is behind: what waits goes in one write
                    batch.append(merged.get_nowait())
                chunks, err = [], None
                for i, ev in batch:
                    if ev["event"] == "tokens":
                        chunks += answers[i].tokens(ev)
                        continue
                    if ev["event"] == "progress":
                        chunks += answers[i].progress(ev) if resp is not None else []
                        continue
                    self.up.finished(open_.pop(i)[0])
                    ends[i] = ev
                    err = err or (api.rejection(ev) if ev["event"] == "error" else api.finish_error(ev))
                    if resp is not None and not err:
                        chunks += answers[i].end(ev, with_usage=len(answers) == 1)
                if err:
                    if resp is None:
                        raise err
                    await resp.write(first.frame(chunks + first.error(err)) + first.closing)
                    return resp
                if resp is not None and chunks:
                    await resp.write(first.frame(chunks))
        finally:
            for task in pumps:
                task.cancel()
        if resp is None:
            return web.json_response(_whole(answers, ends))
        if len(answers) > 1 and req.include_usage:
            await resp.write(first.frame([{**first._base(True), "choices": [], "usage": _usage(ends)}]))
        await resp.write(first.closing)
        return resp

    @staticmethod
    async def _stream_start(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    async def models(self, request: web.Request):
        # aliases and tags: llama-server's fields (--alias, --tags), which OpenAI's clients ignore
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "meshnode",
             "aliases": self.aliases, "tags": self.tags}]})

    async def health(self, request: web.Request):
        try:
            st = await self.up.ask(P.Status(), timeout_s=2.0)
        except (asyncio.TimeoutError, ConnectionError):
            return web.json_response({"status": "error", "detail": "the node does not answer"}, status=503)
        healthy = st.get("node", {}).get("healthy", False)
        return web.json_response({"status": "ok" if healthy else "unhealthy"}, status=200 if healthy else 503)

    async def metrics(self, request: web.Request):
        """The node's Prometheus text (the same as its --metrics-listen serves), where the API is scraped."""
        if not self.serves_metrics:
            raise api.ApiError(501, "this server's /metrics is off (start it without --no-metrics)")
        if self.metrics_from:
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(self.metrics_from, timeout=5).read())
        else:
            try:
                text = (await self.up.ask(P.Metrics(), timeout_s=5.0))["text"].encode()
            except (asyncio.TimeoutError, ConnectionError):
                raise api.ApiError(503, "the node does not answer") from None
        return web.Response(body=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})


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


async def _body(request: web.Request):
    """The request's JSON body, or the 4xx that says why not."""
    try:
        return await asyncio.wait_for(request.json(), BODY_S)
    except asyncio.TimeoutError:
        raise api.ApiError(408, f"the request body did not arrive within {BODY_S:g} s") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise api.ApiError(400, "the request body is not JSON") from None
    except RecursionError:
        raise api.ApiError(400, "the request body nests deeper than this server reads") from None


async def _pump(i: int, q: asyncio.Queue, merged: asyncio.Queue) -> None:
    """One choice's events into the answer's queue, tagged with its index, up to its final one."""
    while True:
        ev = await q.get()
        await merged.put((i, ev))
        if ev["event"] in FINAL:
            return


def _usage(ends: dict[int, dict]) -> dict:
    """The choices' usage: their prompt once (the same prompt), every one's completion."""
    per = [api.usage(ev) for ev in ends.values()]
    prompt = per[0]["prompt_tokens"]
    done = sum(u["completion_tokens"] for u in per)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": per[0]["prompt_tokens_details"]["cached_tokens"]}}


def _whole(answers: dict, ends: dict[int, dict]) -> dict:
    """The non-streamed answer: each choice's, in index order, with the choices' usage."""
    bodies = [answers[i].end(ends[i])[0] for i in sorted(answers)]
    if len(bodies) == 1:
        return bodies[0]
    return {**bodies[0], "choices": [b["choices"][0] for b in bodies],
            "usage": _usage(ends)}


def _error(e: api.ApiError) -> web.Response:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return web.json_response(e.body(), status=e.status, headers=headers)


async def _serve(a, endpoint: str, keys: set[bytes], defaults: dict) -> None:
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
    name, aliases = model_names(a.served_model_name, os.path.basename(node["model"]))
    tags = [t.strip() for t in (a.served_model_tags or "").split(",") if t.strip()]
    gw = Gateway(up, name, piece, keys, a.metrics_from or "", node.get("recipe", ""),
                 node.get("tool_format", "generic"), Cors.of(a.cors_origins), defaults, aliases, tags, not a.no_metrics,
                 a.reasoning_format)
    runner = web.AppRunner(gw.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    hosts, port = hosts_port(a.listen)
    server = await deadline.serve(runner, hosts, port, a.header_timeout_s)
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
    why, defaults = refusal(a.listen, keys, a.insecure), {}
    try:
        defaults = sampling_defaults(a.sampling_defaults)
    except ValueError as e:
        why = why or f"--sampling-defaults: {e}"
    if why:
        print(f"meshnode gateway: {why}", file=__import__("sys").stderr)
        return 2
    asyncio.run(_serve(a, a.node or default_listen(), keys, defaults))
    return 0
