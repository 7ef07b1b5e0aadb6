"""Tool calling through the gateway, with the official `openai` package, on the real model (SmolLM2-135M-
Instruct): calls that always parse and validate against each function's schema, OpenAI's shapes streamed and
not, the history given back, and the pure parts (gateway/tools.py) on their own."""
import json
import os

import jsonschema
import openai
import pytest

from ipc.transport import free_tcp_port
from meshnode.dev.nodeproc import NodeProcess
from meshnode.dev.toolsets import ASK, SCHEMAS, TIME, WEATHER
from meshnode.gateway import tools
from meshnode.ops.realmodel import real_model

pytestmark = pytest.mark.slow  # nodes and llama.cpp engines (the real model, the tiny ones)


@pytest.fixture(scope="module")
def oa(tmp_path_factory):
    from test_gateway import gateway_up

    model = str(real_model("smollm2", tmp_path_factory.mktemp("real")))
    port = free_tcp_port()
    with NodeProcess(model, "--http", f"127.0.0.1:{port}", "--max-active", "4"):
        gateway_up(f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        yield client
        client.close()


def valid_calls(message) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


def test_required_tool_calls_always_parse_and_validate(oa):
    """tool_choice required, 20 seeded answers at temperature 1 within 64 tokens, four at a time (constrained sessions
    batched together): every one is a call whose arguments validate against its function's schema (the
    answer is constrained from its first token)."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(seed):
        return oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                          temperature=1.0, seed=seed, max_tokens=64)

    with ThreadPoolExecutor(4) as pool:
        for r in pool.map(ask, range(20)):  # parallel calls past the budget: the whole ones, finish length
            assert r.choices[0].finish_reason in ("tool_calls", "length"), r.choices[0]
            valid_calls(r.choices[0].message)


def test_an_answer_cut_by_the_budget_gives_the_calls_it_completed_and_no_half_one():
    from meshnode.gateway import tools

    whole = '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}, '
    calls = tools.cut_calls(whole + '{"name": "get_weather", "arguments": {"city": "Par')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "UTC"})]
    assert tools.cut_calls('{"tool_calls": [{"name": "get_time", "argum') is None
    assert tools.cut_calls('{"response": "It is') is None
    hermes = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name'
    assert [c["function"]["name"] for c in tools.cut_calls(hermes, "hermes")] == ["f"]
    # the whole ones end the answer as calls (an agent reads `length` as a truncated answer); none whole: length
    use = tools.ToolUse((), "required", True)
    content, calls, finish = tools.settle(whole + '{"name": "get_weather", "arguments": {"city": "Par', use, "length")
    assert (content, [c["function"]["name"] for c in calls], finish) == (None, ["get_time"], "tool_calls")
    assert tools.settle('{"response": "It is', use, "length") == ("It is", None, "length")
    assert tools.settle('{"tool_calls": [{"name": "get_time", "argum', use, "length") == (None, None, "length")


def test_a_named_function_is_the_one_called_and_parallel_false_calls_one(oa):
    r = oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=3,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}},
                                   parallel_tool_calls=False, max_tokens=200)
    calls = valid_calls(r.choices[0].message)
    assert [c.function.name for c in calls] == ["get_time"]


def test_auto_answers_with_text_or_a_call_and_none_is_plain_chat(oa):
    for seed in range(3):
        r = oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="auto",
                                       temperature=1.0, seed=seed, max_tokens=200)
        m = r.choices[0].message
        assert (m.tool_calls and r.choices[0].finish_reason == "tool_calls") or \
               (isinstance(m.content, str) and r.choices[0].finish_reason == "stop"), r.choices[0]
    hi = [{"role": "user", "content": "hi"}]
    plain = oa.chat.completions.create(model="m", messages=hi, tools=[WEATHER], tool_choice="none", temperature=0,
                                       max_tokens=64)
    chat = oa.chat.completions.create(model="m", messages=hi, temperature=0, max_tokens=64)  # no tools at all
    assert plain.choices[0].message.content == chat.choices[0].message.content and plain.choices[0].finish_reason == \
        "stop"


def test_a_streamed_call_comes_as_openai_sends_it(oa):
    stream = oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                        temperature=1.0, seed=5, max_tokens=200, stream=True)
    heads, args, finish = [], {}, None
    for chunk in stream:
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or ():
            if d.id:
                heads.append((d.index, d.id, d.type, d.function.name))
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        finish = ch.finish_reason or finish
    assert finish == "tool_calls" and heads and all(t == "function" and n == "get_weather" for _, _, t, n in heads)
    for i, _, _, name in heads:
        jsonschema.validate(json.loads(args[i]), SCHEMAS[name])


def test_a_conversation_with_a_call_and_its_result_goes_on(oa):
    first = oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=200)
    call = valid_calls(first.choices[0].message)[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    after = oa.chat.completions.create(model="m", messages=history, tools=[WEATHER], temperature=0, max_tokens=100)
    assert after.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert after.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the call and its result are in the prompt


@pytest.mark.parametrize("body, words", [
    ({"tools": [{"type": "function"}]}, "function"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_malformed_tool_requests_are_named(body, words):
    with pytest.raises(tools.ToolError, match=words):
        tools.parse({"messages": ASK, **body})


def test_arguments_are_closed_as_the_schema_says_and_parallel_calls_bounded():
    """An object that declares its properties takes no others unless its schema allows them; one that declares
    none takes a bounded number; a parallel answer holds at most MAX_CALLS calls. (A small model otherwise
    writes keys or calls until max_tokens cuts the answer.)"""
    loose = {"type": "object", "properties": {"city": {"type": "string"}, "opts": {"type": "object"},
                                              "more": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                       "additionalProperties": True}}}
    use = tools.parse({"tools": [{"type": "function", "function": {"name": "f", "parameters": loose}}],
                       "tool_choice": "required"})
    schema = use.schema()
    call = lambda args, n=1: {"tool_calls": [{"name": "f", "arguments": args}] * n}  # noqa: E731
    jsonschema.validate(call({"city": "Paris", "opts": {"a": 1}, "more": {"x": 1, "y": 2}}), schema)
    for bad in ({"city": "Paris", "country": "FR"}, {"opts": {f"k{i}": i for i in range(tools.MAX_OPEN_KEYS + 1)}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call(bad), schema)
    jsonschema.validate(call({"city": "x"}, tools.MAX_CALLS), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(call({"city": "x"}, tools.MAX_CALLS + 1), schema)
    assert loose["properties"]["opts"] == {"type": "object"}  # the request's own schema is left as it was


def test_a_call_cut_by_max_tokens_is_no_text_and_a_cut_text_answer_keeps_its_text():
    from meshnode.gateway.api import Answer, parse

    def ended(text, choice="required"):
        req = parse({"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 8}, True, "m",
                    lambda: "s1")
        a = Answer(req)
        a.tokens({"event": "tokens", "id": "s1", "tokens": [5], "text": text})
        return a.end({"event": "done", "id": "s1", "reason": "LENGTH", "tokens": [5], "text": text,
                      "usage": {"prompt_tokens": 3, "completion_tokens": 8}})[0]["choices"][0]

    cut = ended('{"tool_calls":[{"name":"get_weather","arguments":{"ci')
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None and "tool_calls" not in cut["message"]
    text = ended('{"response": "It is sunny in Par', "auto")
    assert text["finish_reason"] == "length" and text["message"]["content"] == "It is sunny in Par"


def test_the_schema_and_the_answer_forms():
    use = tools.parse({"tools": [WEATHER, TIME], "tool_choice": "auto"})
    good = {"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}
    jsonschema.validate(good, use.schema())
    jsonschema.validate({"response": "hello"}, use.schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {"city": "x"}}]}, use.schema())
    content, calls = tools.answer(json.dumps(good))
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert tools.answer('{"response": "hi"}') == ("hi", None) and tools.answer('{"tool_') == ('{"tool_', None)


# -- a template's own tool format (Qwen2.5's hermes, Llama 3.1's JSON) on the tiny BPE demo model ---------
@pytest.fixture(scope="module", params=["qwen2.5", "llama-3.1"])
def native(request, tmp_path_factory):
    """A gateway over a node whose model carries that family's template (random weights: what the tests
    judge is the form, which the constraint holds whatever the weights)."""
    from test_gateway import gateway_up

    from meshnode.ops.models import make_model

    with open(os.path.join(os.path.dirname(__file__), "data", "templates", f"{request.param}.jinja")) as f:
        source = f.read()
    model = str(make_model(tmp_path_factory.mktemp("native") / "m.gguf", "tiny-bpe", 0, chat_template=source))
    port = free_tcp_port()
    with NodeProcess(model, "--http", f"127.0.0.1:{port}", "--max-active", "4") as node, node.client() as c:
        gateway_up(f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        yield request.param, c.status()["node"]["tool_format"], client
        client.close()


def test_a_templates_own_tool_format_is_used_and_its_calls_always_parse_and_validate(native):
    label, form, oa = native
    assert form == {"qwen2.5": "hermes", "llama-3.1": "llama3"}[label]
    for seed in range(5):
        r = oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=300)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        assert len(valid_calls(r.choices[0].message)) == 1
    named = oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=9,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=300)
    assert [c.function.name for c in valid_calls(named.choices[0].message)] == ["get_time"]
    history = ASK + [named.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": named.choices[0].message.tool_calls[0].id, "name": "get_time",
                      "content": "12:00"}]
    after = oa.chat.completions.create(model="m", messages=history, tools=[WEATHER, TIME], temperature=0,
                                       max_tokens=20)  # the template renders the call and its result its own way
    assert after.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert after.usage.prompt_tokens > named.usage.prompt_tokens


def test_the_native_forms_parse_what_their_grammars_allow():
    hermes = tools.parse({"tools": [WEATHER, TIME], "tool_choice": "auto"}, "hermes")
    assert hermes.constraint().kind == "lark" and "<tool_call>" in hermes.constraint().spec
    two = '<tool_call>\n{"name":"get_time","arguments":{"zone":"UTC"}}\n</tool_call>\n<tool_call>\n' \
          '{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius"}}\n</tool_call>'
    content, calls = tools.answer(two, "hermes")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert tools.answer("It is noon.", "hermes") == ("It is noon.", None)
    content, calls = tools.answer('{"name":"get_time","parameters":{"zone":"UTC"}}', "llama3")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    assert tools.answer('{"name":"get_ti', "llama3") == ('{"name":"get_ti', None)  # cut short: the text as it is
    wire = tools.history({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}, "hermes")
    assert wire == {"content": "", "tool_calls": [{"id": "c1", "name": "get_time", "arguments": '{"zone": "UTC"}'}]}


@pytest.mark.parametrize("body", [
    {"tool_choice": {"function": "f"}},  # the name where a map belongs: a 500 before
    {"tool_choice": {"type": "function", "function": "f"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"default": b"\x00"}}}]},
], ids=["no type", "function a string", "bin in parameters"])
def test_a_malformed_tool_request_is_a_tool_error_not_a_crash(body):
    from meshnode.gateway.tools import ToolError, parse

    with pytest.raises(ToolError):
        parse({"tools": [{"type": "function", "function": {"name": "f"}}], **body})


def test_an_earlier_calls_arguments_nested_970_deep_are_a_tool_error():
    from meshnode.gateway.tools import ToolError, history

    deep = "[" * 970 + "]" * 970
    with pytest.raises(ToolError, match="nests deeper"):
        history({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": deep}}]})
