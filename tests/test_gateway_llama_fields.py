"""llama-server's own fields on the gateway's OpenAI surface (gateway/llamaext.py): timings, prompt_progress,
__verbose, the context-size error body, aliases and tags, /metrics off. llama.cpp's server tests check them on
llama-server (`python -m benchmarks llamatests`); these check what they mean, against the node's own usage."""
import asyncio
import json

import httpx
import pytest

from benchmarks.llamashim import translate
from gateway_node import auth
from meshnode.core.types import model_names
from meshnode.gateway import api
from meshnode.gateway.server import Gateway

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
    args, _ = translate(["--model", "m.gguf", "--tags", "a,b"], "/tmp/x")
    assert "--no-http-metrics" in args and args[args.index("--served-model-tags") + 1] == "a,b"
    assert "--no-http-metrics" not in translate(["--model", "m.gguf", "--metrics"], "/tmp/x")[0]


def test_anthropic_count_tokens_is_the_prompt_a_message_request_gets(served):
    base, _, c, _ = served
    body = {"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "hello mesh"}]}
    r = httpx.post(f"{base}/v1/messages/count_tokens", json=body, headers=auth(), timeout=60)
    n = r.json()["input_tokens"]
    ans = httpx.post(f"{base}/v1/messages", json={**body, "max_tokens": 2}, headers=auth(), timeout=60).json()
    assert r.status_code == 200 and n == ans["usage"]["input_tokens"] > 0
    bad = httpx.post(f"{base}/v1/messages/count_tokens", json={"messages": []}, headers=auth(), timeout=60)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
