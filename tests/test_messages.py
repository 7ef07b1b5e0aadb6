"""Anthropic's Messages API (/v1/messages) through the gateway, with the official `anthropic` package (a client
nobody here wrote) on the real model (SmolLM2-135M-Instruct): the same answer as the chat it means, streamed
and not, the stream's events as the SDK's own parser accumulates them, a tool round trip (tool_use ->
tool_result -> answer), keys in x-api-key, and Anthropic's error shape for what the API refuses."""
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from gateway_node import gateway_up
from ipc.transport import free_tcp_port
from meshnode.dev.nodeproc import NodeProcess
from meshnode.gateway import messages
from meshnode.ops.realmodel import real_model

pytestmark = pytest.mark.slow  # a node on the real model

WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the best book"}]
GREEDY = {"temperature": 0}  # the SDK of this date no longer lists temperature (the API still takes it)


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    model = str(real_model("smollm2", tmp_path_factory.mktemp("real")))
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("sk-test\n")
    port = free_tcp_port()
    with NodeProcess(model, "--http", f"127.0.0.1:{port}", "--max-active", "4", "--http-api-key-file", str(keys)):
        base = f"http://127.0.0.1:{port}"
        gateway_up(base, headers={"Authorization": "Bearer sk-test"})
        ac = anthropic.Anthropic(base_url=base, api_key="sk-test", max_retries=0, timeout=120)
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0, timeout=120)
        yield ac, oa, base
        ac.close()
        oa.close()


def test_a_message_is_the_chat_answer_to_the_same_conversation(clients):
    ac, oa, _ = clients
    m = ac.messages.create(model="m", system="Answer briefly.", messages=ASK, max_tokens=24, extra_body=GREEDY)
    chat = oa.chat.completions.create(model="m", messages=[{"role": "system", "content": "Answer briefly."}, *ASK],
                                      max_tokens=24, temperature=0)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text" and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)


def test_a_streamed_message_is_what_the_sdks_parser_accumulates_and_the_same_seeded_answer(clients):
    ac, _, _ = clients
    with ac.messages.stream(model="m", messages=ASK, max_tokens=12, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    plain = ac.messages.create(model="m", messages=ASK, max_tokens=12, extra_body=GREEDY)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == plain.content[0].text and final.stop_reason == plain.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12


def test_a_stop_sequence_is_named_in_the_answer(clients):
    ac, _, _ = clients
    free = ac.messages.create(model="m", messages=ASK, max_tokens=40, extra_body=GREEDY).content[0].text
    word = free.split()[2] if len(free.split()) > 3 else free[:3]
    m = ac.messages.create(model="m", messages=ASK, max_tokens=40, extra_body=GREEDY, stop_sequences=[word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word


def test_a_tool_round_trip_tool_use_then_tool_result_then_an_answer(clients):
    ac, _, _ = clients
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    m = ac.messages.create(model="m", messages=ask, tools=[WEATHER], max_tokens=64, extra_body=GREEDY,
                           tool_choice={"type": "any", "disable_parallel_tool_use": True})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", m.content
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with ac.messages.stream(model="m", messages=ask, tools=[WEATHER], max_tokens=200, extra_body=GREEDY,
                            tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content if b.type == "tool_use"] and streamed.stop_reason == "tool_use"
    history = ask + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                   "content": "22 degrees and sunny"}]}]
    after = ac.messages.create(model="m", messages=history, tools=[WEATHER], max_tokens=32, extra_body=GREEDY)
    assert after.usage.input_tokens > m.usage.input_tokens + 10  # the call and its result are in the prompt
    assert after.content and after.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("body, words", [
    ({"messages": ASK}, "max_tokens"),
    ({"messages": [{"role": "robot", "content": "hi"}], "max_tokens": 4}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "image"),
    ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [], "max_tokens": 4}, "messages"),
])
def test_what_the_api_refuses_is_a_400_in_anthropics_shape(clients, body, words):
    ac, _, base = clients
    r = httpx.post(f"{base}/v1/messages", json={"model": "m", **body}, headers={"x-api-key": "sk-test"}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and words in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model="m", **{"max_tokens": 4, **body} if "max_tokens" in body else {**body,
                                                                                                  "max_tokens": 0})


def test_a_wrong_key_is_anthropics_401_and_the_bearer_form_is_accepted_too(clients):
    _, _, base = clients
    body = {"model": "m", "messages": ASK, "max_tokens": 2}
    r = httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{base}/v1/messages", json=body, headers={"Authorization": "Bearer sk-test"},
                      timeout=60).status_code == 200


def test_messages_requests_become_the_chats_they_mean():
    chat = messages.to_chat({
        "max_tokens": 9, "system": [{"type": "text", "text": "S"}], "stop_sequences": ["x"], "top_k": 5,
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [
                         {"type": "text", "text": "t"},
                         {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "ok"},
                                                  {"type": "text", "text": "and?"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}})
    assert chat["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "t", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": 1})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "and?"}]
    assert chat["stop"] == ["x"] and chat["top_k"] == 5 and chat["max_tokens"] == 9
    assert chat["tool_choice"] == "required" and chat["tools"][0]["function"]["name"] == "f"
