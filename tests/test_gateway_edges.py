"""The gateway's HTTP edges through a node: error bodies, size limits, API keys, CORS, paths without /v1,
header deadlines, a non-loopback listener without keys, llama-server's own fields (gateway/llamaext.py) and
Anthropic's count_tokens (tests/test_gateway.py: the answers themselves)."""
import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from gateway_node import auth, gateway_up
from helpers import serve
from ipc.transport import free_tcp_port
from meshnode.core import reasons as R
from meshnode.core.types import model_names
from meshnode.dev.nodeproc import NodeProcess
from meshnode.gateway import api
from meshnode.gateway.server import Gateway


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


@pytest.mark.parametrize("messages", [None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
                                      [{"role": "system", "content": "test"}, {}]])
def test_malformed_messages_are_400s(served, messages):
    r = httpx.post(f"{served[0]}/v1/chat/completions", headers=auth(), json={"messages": messages}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_a_non_loopback_gateway_without_keys_is_refused_in_one_line(tiny_model):
    from helpers import serve

    out = serve(tiny_model, "--http", "0.0.0.0:8089")
    lines = [ln for ln in out.stderr.splitlines() if "http" in ln]
    assert out.returncode == 2 and len(lines) == 1 and "http_api_key_file" in lines[0], out.stderr
    out = subprocess.run([sys.executable, "-m", "meshnode", "gateway", "--listen", "0.0.0.0:8089"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--api-key-file" in out.stderr, out.stderr


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
            except ConnectionResetError:  # closed with headers unread: the kernel answers with a reset
                closed = True
            finally:
                slow.setblocking(True)
            if closed:
                break
        mute.settimeout(30)
        try:
            mute_closed = mute.recv(4096) == b""
        except ConnectionResetError:
            mute_closed = True
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


# -- llama-server's own fields; they mean what the node's own usage says --------------------------------------
CHAT = {"model": "m", "messages": [{"role": "user", "content": "tell me about the mesh"}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}


def _events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_timings_match_the_usage_and_verbose_shows_the_rendered_prompt(served):
    base = served[0]
    body = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "verbose": True}, headers=auth(), timeout=60).json()
    t, u = body["timings"], body["usage"]
    assert t["prompt_n"] + t["cache_n"] == u["prompt_tokens"] and t["cache_n"] == u["prompt_tokens_details"][
        "cached_tokens"]
    assert t["predicted_n"] == u["completion_tokens"] == 6 and t["predicted_ms"] >= 0 and t["prompt_ms"] >= 0
    assert "tell me about the mesh" in body["__verbose"]["prompt"]
    plain = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=auth(), timeout=60).json()
    assert "__verbose" not in plain and "timings" in plain


def test_a_stream_reports_its_prompt_before_its_tokens_and_timings_with_them(served):
    base = served[0]
    ask = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "return_progress": True,
           "timings_per_token": True}
    events = _events(httpx.post(f"{base}/v1/chat/completions", json=ask, headers=auth(), timeout=60))
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    first_text = next(i for i, e in enumerate(events) if e["choices"] and e["choices"][0]["delta"].get("content"))
    assert len(progress) >= 2 and all("prompt_progress" not in e for e in events[first_text:])
    assert progress[0]["cache"] == progress[0]["processed"] and progress[-1]["processed"] == progress[-1]["total"]
    assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)
    usage = next(e for e in events if e.get("usage"))
    assert usage["timings"]["predicted_n"] == usage["usage"]["completion_tokens"]
    assert usage["timings"]["cache_n"] == progress[0]["cache"]
    texts = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert texts and all(e["timings"]["prompt_n"] == progress[-1]["total"] - progress[-1]["cache"] for e in texts)
    # not asked: none of them
    quiet = _events(httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth(),
                               timeout=60))
    assert not any("prompt_progress" in e for e in quiet)
    assert [("timings" in e) for e in quiet] == [False] * (len(quiet) - 1) + [True]  # the finish chunk's


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_past_the_context_gets_llama_servers_error_body(served, stream):
    base = served[0]
    ask = {**CHAT, "messages": [{"role": "user", "content": "the mesh node serves " * 4000}], "max_tokens": None,
           "stream": stream}
    r = httpx.post(f"{base}/v1/chat/completions", json=ask, headers=auth(), timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "exceed_context_size_error"
    assert err["n_prompt_tokens"] > err["n_ctx"] > 0


def test_models_lists_aliases_and_tags():
    assert model_names("tinyllama-2,fim,code", "x.gguf") == ("code", ["code", "fim", "tinyllama-2"])
    assert model_names(None, "x.gguf") == ("x.gguf", ["x.gguf"])
    gw = Gateway(None, "code", aliases=["code", "fim"], tags=["chat"])
    body = json.loads(asyncio.run(gw.models(None)).text)["data"][0]
    assert (body["id"], body["aliases"], body["tags"]) == ("code", ["code", "fim"], ["chat"])


def test_metrics_off_is_501_as_llama_server_without_metrics():
    with pytest.raises(api.ApiError) as e:
        asyncio.run(Gateway(None, "m", metrics=False).metrics(None))
    assert e.value.status == 501 and e.value.body()["error"]["type"] == "not_supported_error"


def test_anthropic_count_tokens_is_the_prompt_a_message_request_gets(served):
    base, _, c, _ = served
    body = {"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "hello mesh"}]}
    r = httpx.post(f"{base}/v1/messages/count_tokens", json=body, headers=auth(), timeout=60)
    n = r.json()["input_tokens"]
    ans = httpx.post(f"{base}/v1/messages", json={**body, "max_tokens": 2}, headers=auth(), timeout=60).json()
    assert r.status_code == 200 and n == ans["usage"]["input_tokens"] > 0
    bad = httpx.post(f"{base}/v1/messages/count_tokens", json={"messages": []}, headers=auth(), timeout=60)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
