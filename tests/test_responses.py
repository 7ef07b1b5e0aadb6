"""OpenAI's Responses API (/v1/responses) through the gateway, with the official `openai` package's
`responses.create` on the real model (SmolLM2-135M-Instruct): the same answer as the chat it means, the
stream's events in OpenAI's order (llama.cpp's tools/server/tests/unit/test_compat_oai_responses.py was the
checklist), function calls and their results given back, and what a stateless server refuses."""
import json

import httpx
import jsonschema
import openai
import pytest

from ipc.transport import free_tcp_port
from meshnode.dev.nodeproc import NodeProcess
from meshnode.gateway import api, responses
from meshnode.ops.realmodel import real_model

pytestmark = pytest.mark.slow  # a node on the real model

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def oa(tmp_path_factory):
    from test_gateway import gateway_up

    model = str(real_model("smollm2", tmp_path_factory.mktemp("real")))
    port = free_tcp_port()
    with NodeProcess(model, "--http", f"127.0.0.1:{port}", "--max-active", "4"):
        base = f"http://127.0.0.1:{port}"
        gateway_up(base)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        yield client, base
        client.close()


def test_a_response_is_the_chat_answer_to_the_same_conversation(oa):
    client, _ = oa
    r = client.responses.create(model="m", instructions="Answer briefly.", input=ASK[1:], max_output_tokens=24,
                                temperature=0)
    chat = client.chat.completions.create(model="m", messages=[{"role": "system", "content": "Answer briefly."},
                                                                *ASK[1:]], max_tokens=24, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.output[0].id.startswith("msg_")
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == {"length": "incomplete", "stop": "completed"}[chat.choices[0].finish_reason]
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.max_output_tokens == 24 and r.instructions == "Answer briefly."
    plain = client.responses.create(model="m", input="What is the best book", max_output_tokens=8, temperature=0)
    alone = client.chat.completions.create(model="m", messages=[ASK[1]], max_tokens=8, temperature=0)
    assert plain.output_text == alone.choices[0].message.content  # a string input is one user message


def test_a_streamed_response_tells_its_events_in_openais_order(oa):
    client, _ = oa
    events = list(client.responses.create(model="m", input=ASK, max_output_tokens=8, temperature=0.8, stream=True,
                                          extra_body={"seed": 3}))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # 8 tokens cannot end this answer
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    msg = events[2].item.id
    assert msg.startswith("msg_") and all(e.item_id == msg for e in events if hasattr(e, "item_id"))
    final = events[-1].response
    assert final.id == events[0].response.id and final.id.startswith("resp_") and final.output[0].id == msg
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.usage.output_tokens == 8 and final.incomplete_details.reason == "max_output_tokens"
    same = client.responses.create(model="m", input=ASK, max_output_tokens=8, temperature=0.8, extra_body={"seed": 3})
    assert same.output_text == final.output_text  # streamed or not, one seeded answer


def test_a_function_call_comes_as_an_item_streamed_or_not_and_its_result_goes_back(oa):
    client, _ = oa
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    r = client.responses.create(model="m", input=ask, tools=[WEATHER], tool_choice="required", temperature=0,
                                max_output_tokens=64, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed" and calls[0].name == "get_weather", r.output
    for c in calls:
        assert c.id.startswith("fc_") and c.call_id.startswith("call_")
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    events = list(client.responses.create(model="m", input=ask, tools=[WEATHER], temperature=0, max_output_tokens=200,
                                          tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    items = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in items] == ["function_call"] * len(items) and items
    for item in items:
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == item.id]
        assert "".join(deltas) == item.arguments
    history = ask + [{"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                      "arguments": calls[0].arguments},
                     {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 degrees and sunny"}]
    after = client.responses.create(model="m", input=history, tools=[WEATHER], temperature=0, max_output_tokens=48)
    assert after.usage.input_tokens > r.usage.input_tokens + 10  # the call and its result are in the prompt
    assert after.status in ("completed", "incomplete") and after.output


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
])
def test_what_a_stateless_text_server_cannot_do_is_a_400_naming_the_field(oa, body, param):
    _, base = oa
    r = httpx.post(f"{base}/v1/responses", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_requests_become_the_chats_they_mean():
    chat = responses.to_chat({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 5, "store": False, "temperature": 0.3,
        "input": [{"role": "developer", "content": "Rules."},
                  {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "done"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Rules."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    assert chat["max_tokens"] == 5 and chat["temperature"] == 0.3 and "store" not in chat
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    req = api.parse({k: v for k, v in chat.items() if k not in ("tools", "tool_choice", "response_format")}, True, "m",
                    lambda: "id1")
    assert req.submit.max_tokens == 5 and len(req.submit.messages) == 5
