"""A reasoning model's thought parsed out of its answer (gateway/reasoning.py): token streams cut anywhere, on a
template that opens the thought and on answers that open it themselves; and through a node whose generated
model's template opens one, every path the same."""
import json
import os

import httpx
import pytest

from gateway_node import gateway_up
from ipc.transport import free_tcp_port
from meshnode.dev.nodeproc import NodeProcess
from meshnode.gateway.reasoning import CLOSE, OPEN, Thought
from meshnode.ops.models import make_model


def _split(pieces, opened=False):
    t, r, c = Thought(opened), "", ""
    for p in [*pieces, None]:
        a, b = t.end() if p is None else t.feed(p)
        r, c = r + a, c + b
    if r:
        assert OPEN not in c and CLOSE not in c  # no tag of a thought ever goes out as content
    return r, c


ANSWERS = [  # (the model's text, opened by the template, thought, content)
    ("<think>\nweigh it\n</think>\n\nIt is 4.", False, "\nweigh it\n", "It is 4."),
    ("weigh it</think>It is 4.", True, "weigh it", "It is 4."),
    ("It is 4.", False, "", "It is 4."),
    ("  no <think> here", False, "", "  no <think> here"),  # a tag mid-answer is its text
    ("<think>cut by the budget", False, "cut by the budget", ""),
    ("a < b, a </thin b", True, "a < b, a </thin b", ""),
]


@pytest.mark.parametrize("text, opened, thought, content", ANSWERS)
def test_a_thought_is_split_off_wherever_the_stream_cuts_it(text, opened, thought, content):
    assert _split([text], opened) == (thought, content)
    for cut in range(1, len(text)):  # every cut in two, and one character at a time
        assert _split([text[:cut], text[cut:]], opened) == _split([text], opened)
    assert _split(list(text), opened) == _split([text], opened)


THINKING_CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_a_template_that_opens_a_thought_gets_it_as_reasoning_on_the_http_paths(tmp_path):
    model = str(make_model(os.path.join(tmp_path, "thinks.gguf"), "tiny-bpe", 0, chat_template=THINKING_CHATML))
    port = free_tcp_port()
    ask = {"model": "m", "messages": [{"role": "user", "content": "think"}], "max_tokens": 12, "temperature": 0,
           "ignore_eos": True}
    with NodeProcess(model, "--http", f"127.0.0.1:{port}"):
        base = f"http://127.0.0.1:{port}/v1"
        gateway_up(base[:-3])
        whole = httpx.post(f"{base}/chat/completions", json=ask, timeout=60).json()["choices"][0]["message"]
        # random weights never close the thought: all of it is reasoning, none content
        assert whole["reasoning_content"] and whole["content"] == ""
        raw = httpx.post(f"{base}/chat/completions", json={**ask, "reasoning_format": "none"}, timeout=60).json()
        assert raw["choices"][0]["message"]["content"] == whole["reasoning_content"]
        lines = httpx.post(f"{base}/chat/completions", json={**ask, "stream": True}, timeout=60).text.splitlines()
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines if x.startswith("data: {")]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
        assert not "".join(d.get("content") or "" for d in deltas)
        bad = httpx.post(f"{base}/chat/completions", json={**ask, "reasoning_format": "yes"}, timeout=60)
        assert bad.status_code == 400 and "reasoning_format" in bad.json()["error"]["message"]
        # Responses: a reasoning item before the message; Messages: a thinking block before the text
        body = {"model": "m", "input": "think", "max_output_tokens": 12, "temperature": 0}
        r = httpx.post(f"{base}/responses", json=body, timeout=60).json()
        assert [o["type"] for o in r["output"]] == ["reasoning", "message"]
        assert r["output"][0]["content"][0]["text"] == whole["reasoning_content"]
        events = [json.loads(x[6:]) for x in httpx.post(f"{base}/responses", json={**body, "stream": True},
                                                          timeout=60).text.splitlines() if x.startswith("data: ")]
        assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
            whole["reasoning_content"]
        final = events[-1]["response"]["output"]
        assert [(o["type"], o["content"]) for o in final] == [(o["type"], o["content"]) for o in r["output"]]
        assert not any(e["type"] == "response.output_text.delta" for e in events)
        msg = {"model": "m", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "think"}]}
        m = httpx.post(f"{base}/messages", json=msg, timeout=60).json()
        assert [b["type"] for b in m["content"]] == ["thinking", "text"]
        assert m["content"][0]["thinking"] == whole["reasoning_content"] and m["content"][1]["text"] == ""
        sse = [json.loads(x[6:]) for x in httpx.post(f"{base}/messages", json={**msg, "stream": True},
                                                       timeout=60).text.splitlines() if x.startswith("data: ")]
        starts = [e["content_block"]["type"] for e in sse if e["type"] == "content_block_start"]
        stops = [e["index"] for e in sse if e["type"] == "content_block_stop"]
        thinking = "".join(e["delta"]["thinking"] for e in sse if e["type"] == "content_block_delta")
        assert starts == ["thinking", "text"] and stops == [0, 1] and thinking == m["content"][0]["thinking"]
        import anthropic  # the SDK's own stream parser reads the same blocks

        client = anthropic.Anthropic(base_url=base[:-3], api_key="none", max_retries=0)
        with client.messages.stream(model="m", max_tokens=12, messages=msg["messages"],
                                    extra_body={"temperature": 0}) as stream:
            final = stream.get_final_message()
        assert [(b.type, getattr(b, "thinking", None)) for b in final.content] == [
            ("thinking", m["content"][0]["thinking"]), ("text", None)]
