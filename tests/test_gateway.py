"""The OpenAI HTTP gateway (`serve --http`, `meshnode gateway`), driven by the official `openai` package and
by raw HTTP for the edges. llama.cpp's own server tests (tools/server/tests/unit/test_chat_completion.py,
test_completion.py) were the checklist; what they check that depends on a real model's words is out of
scope here (docs/gateway.md lists it)."""
import json
import subprocess
import sys
import threading

import httpx
import jsonschema
import openai
import pytest

from helpers import assert_routable, serve, wait_until
from ipc.transport import free_tcp_port
from meshnode.core import reasons as R
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess
from meshnode.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def gateway_up(base: str, headers=None) -> None:
    """Until the gateway child answers /health (it starts once the node serves)."""
    def ok():
        try:
            return httpx.get(f"{base}/health", headers=headers, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    assert wait_until(ok, timeout_s=120, every_s=0.2), "the gateway never became healthy"


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """A node with its gateway child, an openai client on it, and the node's own ZeroMQ client."""
    port, metrics = free_tcp_port(), free_tcp_port()
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# one per line\nsk-test-1\n")
    with NodeProcess(tiny_model, "--http", f"127.0.0.1:{port}", "--http-api-key-file", str(keys),
                     "--metrics-listen", f"127.0.0.1:{metrics}", "--max-active", "2", "--max-queue", "0",
                     "--served-model-name", "tiny-chat") as n, \
            n.client() as c:
        base = f"http://127.0.0.1:{port}"
        gateway_up(base)
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test-1", max_retries=0, timeout=120)
        yield base, oa, c, n
        oa.close()


def auth():
    return {"Authorization": "Bearer sk-test-1"}


def test_a_seeded_chat_answer_is_the_protocols_answer_for_the_same_request(served):
    _, oa, c, _ = served
    msgs = [{"role": "user", "content": "hello mesh"}]
    r = oa.chat.completions.create(model="x", messages=msgs, max_tokens=12, temperature=0.9, seed=7)
    ref = c.generate("ref", messages=msgs, max_tokens=12, sampling=Sampling(0.9, 0, 1.0, 7))
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.done["text"]
    assert r.choices[0].finish_reason == {R.LENGTH: "length", R.EOS: "stop"}[ref.done["reason"]]
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (ref.done["usage"]["prompt_tokens"], len(ref.tokens))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    other = oa.chat.completions.create(model="x", messages=msgs, max_tokens=12, temperature=0.9, seed=8)
    assert other.choices[0].message.content != r.choices[0].message.content  # the seed reached the node


# each sampling parameter the gateway passes on, a value that changes a seeded answer of the tiny model, and the
# base it changes (repeat_last_n only counts where a penalty is on)
SAMPLING_PARAMS = [("top_k", 2, {}), ("top_p", 0.3, {}), ("min_p", 0.3, {}), ("repeat_penalty", 1.8, {}),
                   ("repeat_last_n", 0, {"repeat_penalty": 1.8}), ("presence_penalty", 1.5, {}),
                   ("frequency_penalty", 1.5, {})]


@pytest.mark.parametrize("name, value, base", SAMPLING_PARAMS, ids=[p[0] for p in SAMPLING_PARAMS])
def test_every_sampling_parameter_reaches_the_sampler_as_through_the_node_protocol(served, name, value, base):
    """The same options over HTTP and over ZeroMQ give the same seeded answer, and the parameter changes it:
    a gateway that dropped it would answer the base's text."""
    base_url = served[0]
    c = served[2]
    prompt = [5 + k * 37 % 400 for k in range(6)]

    def over_http(extra):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 1.0, "seed": 7, "ignore_eos": True, **extra}
        r = httpx.post(f"{base_url}/v1/completions", json=body, headers=auth(), timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with_it, without = over_http({**base, name: value}), over_http(base)
    sampling = Sampling(**{"temperature": 1.0, "seed": 7, **base, name: value})
    ref = c.generate(f"ref-{name}", tokens=prompt, max_tokens=24, ignore_eos=True, sampling=sampling)
    assert with_it == ref.done["text"] and with_it != without


def test_a_stream_says_the_role_first_then_the_same_text_and_ends_with_usage_when_asked(served):
    _, oa, _, _ = served
    kw = {"model": "x", "messages": [{"role": "user", "content": "count"}], "max_tokens": 20, "temperature": 0.7,
          "seed": 3}
    whole = oa.chat.completions.create(**kw).choices[0].message.content
    chunks = list(oa.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and len({ch.id for ch in chunks}) == 1
    assert all(ch.choices[0].delta.role is None for ch in chunks[1:] if ch.choices)
    assert chunks[0].system_fingerprint == served[2].status()["node"]["recipe"]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_take_text_or_token_ids_and_report_logprobs_by_token_name(served, tiny_model):
    _, oa, c, _ = served
    r = oa.completions.create(model="x", prompt=[5, 9, 33], max_tokens=6, temperature=0, logprobs=2)
    ref = c.generate("ref-lp", tokens=[5, 9, 33], max_tokens=6, logprobs=2)
    tok = Tokenizer(tiny_model)
    try:
        names = [tok.piece(t).decode("utf-8", "replace") for t in ref.tokens]
    finally:
        tok.close()
    lp = r.choices[0].logprobs
    assert r.object == "text_completion" and r.choices[0].text == ref.done["text"]
    assert lp.tokens == names and lp.token_logprobs == [e["logprob"] for ev in ref.events for e in ev["logprobs"]]
    assert all(len(top) == 2 for top in lp.top_logprobs)
    text = oa.completions.create(model="x", prompt="hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 4 and text.choices[0].finish_reason == "length"


def test_chat_logprobs_carry_bytes_and_alternatives(served):
    _, oa, _, _ = served
    r = oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], max_tokens=5, temperature=0,
                                   logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token


def test_a_stop_string_ends_the_answer_before_it(served):
    _, oa, _, _ = served
    kw = {"model": "x", "prompt": "abc", "max_tokens": 30, "temperature": 0, "extra_body": {"ignore_eos": True}}
    free = oa.completions.create(**kw).choices[0].text
    stop = next(free[i:i + 2] for i in range(5, len(free) - 1) if free[i:i + 2].isascii() and free[i:i + 2].isprintable())
    r = oa.completions.create(**kw, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == free[:free.index(stop)]


def test_response_format_json_schema_answers_parse(served):
    _, oa, _, _ = served
    for seed in range(3):
        r = oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "who?"}], max_tokens=80,
                                       seed=seed, response_format={"type": "json_schema", "json_schema": {
                                           "name": "who", "schema": SCHEMA}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("body, status, words", [
    ({"messages": [{"role": "user", "content": "x"}], "n": 9}, 400, "n must be an integer in [1, 8]"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "each tool must be"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400, "functions"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text content"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "objekt"}}}}, 400, "objekt"),
    ({"messages": [{"role": "user", "content": "x"}], "n": True}, 400, "n must be"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "model": 5}, 400, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 2 ** 64}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e30}, 400, "max_tokens"),
])
def test_bad_requests_get_openais_error_body(served, body, status, words):
    base = served[0]
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth(), timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"


def test_over_limit_and_unreadable_bodies_are_answered_at_once(served):
    """A prompt over the node's 256 KiB text limit and a schema whose request is over its 1 MiB message
    limit are 413s (they hung for ever: the node's error named no request); JSON nested deeper than the
    parser goes is a 400 (was a 500). Every request answered, none left registered."""
    base = served[0]
    big = httpx.post(f"{base}/v1/completions", json={"prompt": "a" * 300_000, "max_tokens": 2}, headers=auth(),
                     timeout=60)
    assert big.status_code == 413 and big.json()["error"]["code"] == R.TOO_LARGE, big.text
    enum = {"type": "json_schema", "json_schema": {"schema": {"enum": [f"v{i}" for i in range(100_000)]}}}
    huge = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                      "response_format": enum}, headers=auth(), timeout=60)
    assert huge.status_code == 413, huge.text
    deep = httpx.post(f"{base}/v1/completions", content=b"[" * 100_000, headers=auth(), timeout=60)
    assert deep.status_code == 400, deep.text
    lone = httpx.post(f"{base}/v1/chat/completions", headers=auth(), timeout=60,  # a lone surrogate: no UTF-8
                      content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert lone.status_code == 400 and "encoded" in lone.json()["error"]["message"], lone.text
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200


def test_api_keys_are_utf8_lines_compared_as_bytes_and_a_file_without_one_is_refused(tmp_path, tiny_model):
    """A BOM, a non-ASCII key, an indented comment; a file of comments only must never mean no keys."""
    from ipc.transport import api_keys

    f = tmp_path / "keys"
    f.write_bytes("\ufeffsk-one\n  # a comment, indented\nключ-два\n\n".encode())
    assert api_keys(str(f)) == {b"sk-one", "ключ-два".encode()}
    f.write_text("# nothing but comments\n   \n")
    with pytest.raises(ValueError, match="holds no key"):
        api_keys(str(f))
    out = serve(tiny_model, "--http", "127.0.0.1:1", "--http-api-key-file", str(f))  # refused before anything starts
    assert out.returncode == 2 and "holds no key" in out.stderr, out.stderr


def test_a_non_ascii_authorization_header_is_a_401(served):
    base = served[0]
    for given in ("Bearer ключ".encode(), b"Bearer \xff\xfe", "Bearer sk-test-1\u00e9".encode()):
        r = httpx.get(f"{base}/v1/models", headers={"Authorization": given}, timeout=5)
        assert r.status_code == 401, (given, r.text)


def test_keys_models_health_and_metrics(served):
    base = served[0]
    assert httpx.get(f"{base}/health", timeout=5).json() == {"status": "ok"}  # no key needed
    r = httpx.get(f"{base}/v1/models", timeout=5)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=5).status_code == 401
    models = httpx.get(f"{base}/v1/models", headers=auth(), timeout=5).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-chat"
    text = httpx.get(f"{base}/metrics", headers=auth(), timeout=5).text
    assert "meshnode_requests_running" in text
    assert_routable(text, "tiny-chat")  # the node's figures under vLLM's names, through the gateway
    assert httpx.post(f"{base}/v1/chat/completions", content=b"{not json", headers=auth(), timeout=5).status_code == 400


def test_n_choices_are_sessions_of_their_own_with_their_own_draws(served):
    """`n` choices: one session each (choice i draws with seed + i), streamed with their indexes and given
    back whole in index order; usage counts the prompt once and every choice's completion."""
    oa = served[1]
    ask = dict(model="m", messages=[{"role": "user", "content": "count"}], max_tokens=12, temperature=1.0, seed=5)
    r = oa.chat.completions.create(n=2, **ask)  # the fixture's node runs 2 at once and queues none
    assert [c.index for c in r.choices] == [0, 1] and len({c.message.content for c in r.choices}) > 1
    alone = [oa.chat.completions.create(**{**ask, "seed": 5 + i}).choices[0].message.content for i in range(2)]
    assert [c.message.content for c in r.choices] == alone
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == oa.chat.completions.create(
        **ask).usage.prompt_tokens
    text, finishes = {}, {}
    for chunk in oa.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **ask):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == 24
    assert text == {0: alone[0], 1: alone[1]} and finishes == {0: "length", 1: "length"}


def test_the_api_answers_without_v1_and_pages_of_this_host_by_cors(served):
    """llama-server's and vLLM's clients call the OpenAI paths without /v1 too; a browser page on this host
    gets CORS answers (preflight and the request), another origin only when configured."""
    base = served[0]
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(f"{base}/chat/completions", json=body, headers=auth(), timeout=30).status_code == 200
    assert httpx.post(f"{base}/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth(),
                      timeout=30).json()["object"] == "text_completion"
    assert httpx.get(f"{base}/models", headers=auth(), timeout=5).json()["object"] == "list"
    page = "http://localhost:3000"
    pre = httpx.options(f"{base}/v1/chat/completions", headers={
        "Origin": page, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}, timeout=5)
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == page
    assert "POST" in pre.headers["access-control-allow-methods"] and "authorization" in pre.headers[
        "access-control-allow-headers"]
    r = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": True}, headers={**auth(), "Origin": page},
                   timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    other = httpx.options(f"{base}/v1/models", headers={"Origin": "https://elsewhere.example",
                                                        "Access-Control-Request-Method": "GET"}, timeout=5)
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    plain = httpx.post(f"{base}/v1/chat/completions", json=body, headers={**auth(), "Origin": "https://x.example"},
                       timeout=30)
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_cors_origins_as_configured():
    from meshnode.gateway.cors import Cors

    assert Cors().allowed("http://127.0.0.1:8080") == "http://127.0.0.1:8080" and Cors().allowed("http://[::1]")
    assert Cors().allowed("http://localhost.evil.example") is None and Cors().allowed(None) is None
    some = Cors.of("https://chat.example.com/, https://b.example")
    assert some.allowed("https://chat.example.com") == "https://chat.example.com" and not some.allowed("https://c.x")
    assert Cors.of("*").allowed("https://anything.example") == "*"


def test_a_full_node_answers_429_with_retry_after_and_a_disconnect_cancels(served):
    """Two running (max_active 2, no queue): a third request is refused at once; dropping the streams
    cancels their sessions at the node."""
    base, _, c, _ = served
    streams = []
    body = {"prompt": "go", "max_tokens": 4000, "temperature": 1.0, "stream": True, "ignore_eos": True}
    before = c.status()["telemetry"]["decode_tokens_total"]
    client = httpx.Client(timeout=60, headers=auth())
    try:
        for _ in range(2):
            cm = client.stream("POST", f"{base}/v1/completions", json=body)
            resp = cm.__enter__()
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is running
            streams.append((cm, lines))  # a line iterator dropped closes its stream: keep it
        r = client.post(f"{base}/v1/completions", json={**body, "stream": False})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == R.REJECTED_QUEUE_FULL
    finally:
        for cm, _ in streams:
            cm.__exit__(None, None, None)
        client.close()
    assert wait_until(lambda: c.status()["telemetry"]["active_sessions"] == 0, timeout_s=60, every_s=0.2)
    assert c.status()["telemetry"]["decode_tokens_total"] - before < 4000  # cut short: cancelled, not finished


def test_a_request_whose_client_gives_up_is_cancelled(served):
    """A non-streamed request the client stops waiting for (llama.cpp's test_cancel_request): the
    handler is cancelled with the connection, and the node's session with it."""
    base, _, c, _ = served
    before = c.status()["telemetry"]["decode_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", headers=auth(), timeout=httpx.Timeout(60, read=0.5),
                   json={"prompt": "go", "max_tokens": 4000, "temperature": 1.0, "ignore_eos": True})
    assert wait_until(lambda: c.status()["telemetry"]["active_sessions"] == 0, timeout_s=60, every_s=0.2)
    assert c.status()["telemetry"]["decode_tokens_total"] - before < 4000


@pytest.mark.parametrize("messages", [None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
                                      [{"role": "system", "content": "test"}, {}]])
def test_malformed_messages_are_400s(served, messages):
    r = httpx.post(f"{served[0]}/v1/chat/completions", headers=auth(), json={"messages": messages}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_grammar_and_const_schemas_as_llama_server_takes_them(served):
    base = served[0]
    msgs = [{"role": "user", "content": "x"}]
    r = httpx.post(f"{base}/v1/chat/completions", headers=auth(), timeout=60,
                   json={"messages": msgs, "max_tokens": 6, "grammar": 'root ::= "a"{5,5}'})
    assert r.json()["choices"][0]["message"]["content"] == "aaaaa"
    r = httpx.post(f"{base}/v1/chat/completions", headers=auth(), timeout=60, json={
        "messages": msgs, "max_tokens": 12, "response_format": {"type": "json_schema", "json_schema": {
            "schema": {"const": "foooooo"}}}})
    assert r.json()["choices"][0]["message"]["content"] == '"foooooo"'
    for bad in ({"type": "sound"}, {"type": "json_object", "schema": 123}, {"type": "json_object", "schema": {"type": "hiccup"}}):
        r = httpx.post(f"{base}/v1/chat/completions", headers=auth(), timeout=60,
                       json={"messages": msgs, "max_tokens": 4, "response_format": bad})
        assert r.status_code == 400, (bad, r.text)
    r = httpx.post(f"{base}/v1/chat/completions", headers=auth(), timeout=60,
                   json={"messages": msgs, "max_tokens": 4, "grammar": "root ::= this is (not valid GBNF"})
    assert r.status_code == 400 and "error" in r.json()


def test_a_non_loopback_gateway_without_keys_is_refused_in_one_line(tiny_model):
    from helpers import serve

    out = serve(tiny_model, "--http", "0.0.0.0:8089")
    lines = [ln for ln in out.stderr.splitlines() if "http" in ln]
    assert out.returncode == 2 and len(lines) == 1 and "http_api_key_file" in lines[0], out.stderr
    out = subprocess.run([sys.executable, "-m", "meshnode", "gateway", "--listen", "0.0.0.0:8089"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--api-key-file" in out.stderr, out.stderr


def test_the_node_restarts_a_gateway_that_dies(served):
    base, _, _, n = served
    import psutil

    gw = [p for p in psutil.Process(n.proc.pid).children() if "gateway" in " ".join(p.cmdline())]
    assert len(gw) == 1
    gw[0].kill()
    gateway_up(base)
    again = [p for p in psutil.Process(n.proc.pid).children() if "gateway" in " ".join(p.cmdline())]
    assert len(again) == 1 and again[0].pid != gw[0].pid


def test_many_streams_at_once_each_get_their_own_tokens(served):
    """Sessions multiplexed over the gateway's one connection: eight concurrent requests (two run, the
    rest refused 429 at once: max_queue 0), and each running one gets exactly its own answer."""
    _, oa, c, _ = served
    out, errors = {}, []

    def one(i):
        try:
            r = oa.completions.create(model="x", prompt=f"p{i}", max_tokens=8, temperature=1.0, seed=i)
            out[i] = r.choices[0].text
        except openai.RateLimitError:
            errors.append(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) + len(errors) == 8 and out
    for i, text in out.items():
        assert text == c.generate(f"m{i}", text=f"p{i}", max_tokens=8, sampling=Sampling(1.0, 0, 1.0, i)).done["text"]


# -- the translation alone (meshnode/gateway/api.py) -----------------------------------------------------
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


def test_json_object_answers_are_json_objects(served):
    _, oa, _, _ = served
    for seed in range(3):
        r = oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "json?"}], max_tokens=80,
                                       seed=seed, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        assert isinstance(json.loads(r.choices[0].message.content), dict)


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


def test_a_stream_whose_node_dies_ends_with_an_error_chunk_and_done(tiny_model):
    """The gateway's connection drops when the node dies: each open stream gets one error chunk naming
    NODE_UNREACHABLE and its `[DONE]`, never a hang. The engine is stopped first, so the stream is open
    (admitted, no tokens) when the front is killed: no race with the stream's own end."""
    import os
    import signal

    import psutil

    port = free_tcp_port()
    with NodeProcess(tiny_model, "--max-active", "1") as n:
        gw = subprocess.Popen([sys.executable, "-m", "meshnode", "gateway", "--listen", f"127.0.0.1:{port}",
                               "--node", n.listen], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engine = next(p for p in psutil.Process(n.proc.pid).children() if "spawn_main" in " ".join(p.cmdline()))
        try:
            base = f"http://127.0.0.1:{port}"
            gateway_up(base)
            os.kill(engine.pid, signal.SIGSTOP)
            body = {"prompt": "hello", "max_tokens": 50, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200  # admitted: the stream is open, its tick stuck in the engine
                n.proc.kill()
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            err = json.loads(lines[-2][6:])["error"]
            assert err["code"] == "NODE_UNREACHABLE" and "connection to the node was lost" in err["message"], err
        finally:
            try:
                engine.kill()  # stopped, it cannot act on the SIGTERM its dead front's death sent it
            except psutil.NoSuchProcess:
                pass
            gw.terminate()
            gw.wait(30)


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


def test_a_client_that_trickles_its_headers_is_closed_at_the_deadline_and_others_are_served(served):
    """Slowloris: a byte of headers every 0.2 s. With --header-timeout-s 1 the gateway closes the connection
    while the headers are still coming (before, aiohttp waited for as long as they came); a connection that
    sends nothing is closed the same way; a normal request on the same gateway is answered."""
    import socket
    import time

    n = served[3]
    port = free_tcp_port()
    gw = subprocess.Popen([sys.executable, "-m", "meshnode", "gateway", "--listen", f"127.0.0.1:{port}",
                           "--node", n.listen, "--header-timeout-s", "1"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        gateway_up(f"http://127.0.0.1:{port}")
        slow = socket.create_connection(("127.0.0.1", port))
        mute = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sent, closed = 0, False
        for byte in b"X-Slow: " + b"a" * 200:  # 40 s of headers at this pace
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            sent += 1
            time.sleep(0.2)
            slow.setblocking(False)
            try:
                closed = slow.recv(4096) == b""
            except BlockingIOError:
                pass
            finally:
                slow.setblocking(True)
            if closed:
                break
        mute.settimeout(30)
        mute_closed = mute.recv(4096) == b""
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [3, 4], "max_tokens": 2},
                       timeout=60)
    finally:
        gw.terminate()
        gw.wait(30)
    assert closed and sent < 208, sent  # closed while its headers were still trickling in
    assert mute_closed and r.status_code == 200, r.text


def test_a_request_that_runs_past_the_header_deadline_is_not_cut(tiny_model):
    """The header deadline stops once the application has the request: an answer that takes 3 s or more
    (every tick held 20 ms, 150 tokens) comes whole through a gateway whose header deadline is 1 s."""
    port = free_tcp_port()
    with NodeProcess(tiny_model, internal={"faults": [{"step_sleep_s": 0.02}]}) as n:
        gw = subprocess.Popen([sys.executable, "-m", "meshnode", "gateway", "--listen", f"127.0.0.1:{port}",
                               "--node", n.listen, "--header-timeout-s", "1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        try:
            gateway_up(f"http://127.0.0.1:{port}")
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={"prompt": [3, 4], "max_tokens": 150, "ignore_eos": True})
        finally:
            gw.terminate()
            gw.wait(30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 150, r.text


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
