"""The OpenAI-compatible gateway's own translation, without a node: request defaults, status codes, SSE chunks,
health, CORS, a client that falls behind, errors that name no request (tests/test_gateway.py: through a node)."""
import json

import pytest

from ipc.transport import free_tcp_port
from meshnode.core import reasons as R


def test_cors_origins_as_configured():
    from meshnode.gateway.cors import Cors

    assert Cors().allowed("http://127.0.0.1:8080") == "http://127.0.0.1:8080" and Cors().allowed("http://[::1]")
    assert Cors().allowed("http://localhost.evil.example") is None and Cors().allowed(None) is None
    some = Cors.of("https://chat.example.com/, https://b.example")
    assert some.allowed("https://chat.example.com") == "https://chat.example.com" and not some.allowed("https://c.x")
    assert Cors.of("*").allowed("https://anything.example") == "*"


def parse(body, chat=True):
    from meshnode.gateway import api

    return api.parse(body, chat, "m.gguf", lambda: "s1")


def test_openai_defaults_become_the_nodes_terms():
    """temperature 1 and a fresh seed per request (OpenAI's defaults), no max_tokens = up to the context,
    OpenAI's and llama-server's ways to ask for a format."""
    from meshnode.core.types import ResponseFormat

    a, b = parse({"messages": [{"role": "user", "content": "x"}]}), parse({"messages": [{"role": "user", "content": "x"}]})
    assert a.submit.sampling.temperature == 1.0 and a.submit.sampling.seed != b.submit.sampling.seed
    assert a.submit.max_tokens is None and a.submit.messages == [{"role": "user", "content": "x"}]
    got = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                 "max_completion_tokens": 5, "seed": 3, "stop": "\n", "logprobs": True, "top_logprobs": 0})
    assert got.submit.messages[0]["content"] == "ab" and got.submit.max_tokens == 5 and got.submit.stop == ["\n"]
    assert got.top_logprobs == 0 and got.submit.sampling.logprobs == 1  # the token's own logprob needs one
    schema = {"type": "object"}
    for body, want in (({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
                        ResponseFormat("json_schema", json.dumps(schema))),
                       ({"response_format": {"type": "json_object"}}, ResponseFormat("json_object")),
                       ({"response_format": {"type": "text"}}, None),
                       ({"json_schema": schema}, ResponseFormat("json_schema", json.dumps(schema))),
                       ({"grammar": 'root ::= "a"'}, ResponseFormat("grammar", 'root ::= "a"'))):
        assert parse({"prompt": "x", **body}, chat=False).submit.response_format == want
    assert parse({"prompt": [[1, 2, 3]]}, chat=False).submit.tokens == [1, 2, 3]


@pytest.mark.parametrize("reason, status", [(R.REJECTED_QUEUE_FULL, 429), (R.REJECTED_KV_BUDGET, 429),
                                            (R.REJECTED_DRAINING, 503), (R.REJECTED_CONTEXT_TOO_LONG, 400),
                                            (R.REJECTED_ENGINE_UNAVAILABLE, 503)])
def test_rejections_map_to_status_codes(reason, status):
    from meshnode.gateway import api

    e = api.rejection({"event": "rejected", "id": "s1", "reason": reason, "detail": "why"})
    assert e.status == status and e.body()["error"]["code"] == reason
    assert e.retry_after == (1 if status == 429 else None)


def test_a_stream_of_events_becomes_openais_chunks():
    from meshnode.gateway import api

    req = parse({"messages": [{"role": "user", "content": "x"}], "stream": True,
                 "stream_options": {"include_usage": True}})
    ans = api.Answer(req)
    chunks = ans.tokens({"event": "tokens", "id": "s1", "tokens": [5], "text": "he"})
    chunks += ans.tokens({"event": "tokens", "id": "s1", "tokens": [6], "text": ""})  # a held character: nothing
    chunks += ans.tokens({"event": "tokens", "id": "s1", "tokens": [7], "text": "llo"})
    chunks += ans.end({"event": "done", "id": "s1", "reason": R.EOS, "tokens": [5, 6, 7], "text": "hello",
                       "usage": {"prompt_tokens": 4, "completion_tokens": 3, "cached_tokens": 2}})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas == [{"role": "assistant", "content": None}, {"content": "he"}, {"content": "llo"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, None, "stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2}}
    assert all(c["id"] == "chatcmpl-s1" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert api.finish_error({"reason": R.ENGINE_ERROR, "detail": "engine died"}).status == 503


def test_health_is_503_when_the_node_is_unhealthy_or_silent():
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from meshnode.gateway.server import Gateway

    class Node:
        def __init__(self, answer):
            self.answer = answer

        async def ask(self, req, timeout_s=5.0):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    async def health(answer):
        async with TestClient(TestServer(Gateway(Node(answer), "m").app())) as client:
            resp = await client.get("/health")
            return resp.status, await resp.json()

    assert asyncio.run(health({"node": {"healthy": True}})) == (200, {"status": "ok"})
    assert asyncio.run(health({"node": {"healthy": False}})) == (503, {"status": "unhealthy"})
    status, body = asyncio.run(health(asyncio.TimeoutError()))
    assert status == 503 and body["status"] == "error"


def test_a_client_that_is_behind_gets_what_waited_in_one_write_and_nothing_is_lost(monkeypatch):
    """Events already queued when the handler looks (a slow client, a busy gateway) leave in one write, in
    order, ending with the finish, usage and [DONE]."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from meshnode.gateway.server import Gateway

    class Queued:  # the node answered everything before the handler first looked
        def open(self, submit):
            q = asyncio.Queue()
            for ev in [{"event": "admitted", "id": submit.id},
                       *({"event": "tokens", "id": submit.id, "tokens": [t], "text": w} for t, w in
                         [(5, "a"), (6, "b"), (7, ""), (8, "c")]),
                       {"event": "done", "id": submit.id, "reason": R.LENGTH, "tokens": [5, 6, 7, 8], "text": "abc",
                        "usage": {"prompt_tokens": 2, "completion_tokens": 4}}]:
                q.put_nowait(ev)
            return q

        def finished(self, sid):
            self.ended = sid

    writes = []
    real_write = web.StreamResponse.write

    async def counted(self, data):
        writes.append(data)
        return await real_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counted)

    async def go():
        up = Queued()
        async with TestClient(TestServer(Gateway(up, "m").app())) as client:
            resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True,
                                                               "stream_options": {"include_usage": True}})
            assert resp.status == 200
            return await resp.text(), up

    body, up = asyncio.run(go())
    events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and up.ended
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == ["a", "b", "c", ""]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 4
    assert len(writes) == 2  # the three texts together; then the finish, the usage and [DONE]


def test_an_error_that_names_no_request_never_answers_a_status():
    """A status waiter is answered by a status, never by a stray error (one without an id answered the
    next /health with 503 on a healthy node)."""
    import asyncio

    from ipc import events as E
    from meshnode.gateway.upstream import Upstream

    async def run():
        up = Upstream(f"tcp://127.0.0.1:{free_tcp_port()}")
        up._loop = asyncio.get_running_loop()
        waiter = up._loop.create_future()
        up._replies.append(waiter)
        up._on_event(E.error(R.TOO_LARGE, "payload over 1048576 bytes"))
        stray_answered = waiter.done()
        up._on_event(E.status({"healthy": True}, {}, {}))
        up.sock.close(0)
        up.monitor.close(0)
        up.ctx.term()
        return stray_answered, waiter.result()["event"]

    assert asyncio.run(run()) == (False, "status")


def test_sampling_defaults_fill_what_a_request_leaves_out_and_are_checked_at_start():
    """llama-server's --temp / --seed, vLLM's generation config: the gateway's --sampling-defaults (the node's
    http_sampling_defaults) stand in for options a request omits or sends as null, never for ones it sends."""
    from meshnode.core.types import ConfigError, sampling_defaults
    from meshnode.gateway import api
    from meshnode.ops import config

    d = sampling_defaults('{"temperature": 0.8, "seed": 42, "top_k": 40}')
    ask = {"messages": [{"role": "user", "content": "x"}]}
    s = api.parse(ask, True, "m", lambda: "i", defaults=d).submit.sampling
    assert (s.temperature, s.seed, s.top_k) == (0.8, 42, 40)
    s = api.parse({**ask, "temperature": 0.1, "seed": None}, True, "m", lambda: "i", defaults=d).submit.sampling
    assert (s.temperature, s.seed) == (0.1, 42)
    assert api.parse(ask, True, "m", lambda: "i").submit.sampling.temperature == 1.0  # OpenAI's, without defaults
    for bad, words in (('{"tempo": 1}', "unknown option 'tempo'"), ('{"seed": 4.2}', "seed must be an int"),
                       ("[1]", "JSON object"), ("{", "not JSON"), ('{"top_p": true}', "top_p must be a number")):
        with pytest.raises(ValueError, match=words):
            sampling_defaults(bad)
        with pytest.raises(ConfigError, match=f"http_sampling_defaults: .*{words}"):
            config.NodeConfig(http="127.0.0.1:8080", http_sampling_defaults=bad).validate()
