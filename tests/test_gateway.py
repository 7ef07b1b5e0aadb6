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

from gateway_node import auth, gateway_up
from helpers import assert_routable, wait_until
from ipc.transport import free_tcp_port
from meshnode.core import reasons as R
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess
from meshnode.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


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


def test_json_object_answers_are_json_objects(served):
    _, oa, _, _ = served
    for seed in range(3):
        r = oa.chat.completions.create(model="x", messages=[{"role": "user", "content": "json?"}], max_tokens=80,
                                       seed=seed, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        assert isinstance(json.loads(r.choices[0].message.content), dict)


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
