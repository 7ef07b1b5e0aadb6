"""OpenAI tool calling in the node's terms, with no I/O: the tools are shown to the model, its answer is
constrained from its first token to calls whose arguments match each function's JSON schema or (with
`tool_choice: auto`) plain text, and the finished text becomes OpenAI's `tool_calls`.

Where the model's chat template has its own tool format (the node's `status.node.tool_format`, told by
meshnode/text/jinja.py), that format is used, as llama-server does: the tools, earlier calls and results go
to the template as structured data and it lists them its own way, and the answer is constrained to the
format the model was trained on (an llguidance Lark grammar with the functions' schemas inline):
  hermes (Qwen2.5, Hermes 2 Pro):  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>  (one or more)
  llama3 (Llama 3.1-3.3):          {"name": "f", "parameters": {...}}                               (one)
Elsewhere the form is this gateway's own generic one (llama-server's generic handler is the model), the
tools listed in the system turn, a JSON answer that parses on any model, a 135M one included:
  {"tool_calls": [{"name": "<function>", "arguments": {...}}, ...]}    or    {"response": "<text>"}
with earlier turns given back in that form: an assistant message's `tool_calls` as that JSON, a `tool`
message's result as {"tool_response": {"tool_call_id", "name", "content"}}.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from ipc import jsonvalue
from meshnode.core.types import ResponseFormat

NATIVE = {"hermes": "arguments", "llama3": "parameters"}  # the key a format's call holds its arguments under
# calls one parallel answer may hold: a small model left unbounded repeats calls until max_tokens cuts the
# answer (SmolLM2-135M at temperature 1, 1 in 20 seeded answers on an AVX-512 CPU, 200 tokens)
MAX_CALLS = 4
MAX_OPEN_KEYS = 8  # keys an object with no declared properties may hold (see closed)
NO_WHITESPACE = {"x-guidance": {"whitespace_flexible": False}}  # compact JSON, as text/constraints.py asks
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ToolError(ValueError):
    """A tools request OpenAI's API would refuse: (message, param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolUse:
    functions: tuple  # ({name, description, parameters}, ...)
    choice: str  # "auto", "required", or the one function's name
    parallel: bool
    form: str = "generic"  # the template's tool format (module docstring)

    def _call(self, key: str = "arguments") -> dict:
        """The JSON schema of one call of an allowed function, its arguments under `key`."""
        allowed = [f for f in self.functions if self.choice in ("auto", "required") or f["name"] == self.choice]
        items = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: closed(f["parameters"])},
                  "required": ["name", key], "additionalProperties": False} for f in allowed]
        return items[0] if len(items) == 1 else {"anyOf": items}

    def constraint(self) -> ResponseFormat:
        """What the answer is held to, from its first token."""
        if self.form not in NATIVE:
            return ResponseFormat("json_schema", json.dumps(self.schema()))
        call = json.dumps({**self._call(NATIVE[self.form]), **NO_WHITESPACE})
        if self.form == "hermes":
            more = " ".join(["(\"\\n\" call)?"] * (MAX_CALLS - 1))
            rules = [f"call: \"<tool_call>\\n\" %json {call} \"\\n</tool_call>\"",
                     f"calls: call {more}" if self.parallel else "calls: call", "TEXT: /[^<](?s:.)*/"]
        else:  # llama3: one call, a bare JSON object
            rules = [f"calls: %json {call}", "TEXT: /[^{](?s:.)*/"]
        start = "start: calls | TEXT" if self.choice == "auto" else "start: calls"
        return ResponseFormat("lark", "\n".join([start, *rules]))

    def wire(self) -> list[dict]:
        """The functions as the node's submit carries them for the template (ipc/chat.py)."""
        return [{"name": f["name"], "description": f["description"] or "", "parameters": json.dumps(f["parameters"])}
                for f in self.functions]

    def schema(self) -> dict:
        """The JSON schema every answer of this request matches (the generic form)."""
        calls = {"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": self._call(), "minItems": 1, "maxItems": MAX_CALLS if self.parallel else 1}},
            "required": ["tool_calls"], "additionalProperties": False}
        if self.choice != "auto":
            return calls
        text = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
        return {"anyOf": [calls, text]}

    def system_text(self) -> str:
        listed = json.dumps([{"name": f["name"], "description": f["description"] or "",
                              "parameters": f["parameters"]} for f in self.functions], ensure_ascii=False)
        how = ('To call tools, answer with JSON only: {"tool_calls": [{"name": "<tool name>", "arguments": '
               '{<arguments matching its parameters>}}]}.')
        if self.choice == "auto":
            how += ' To answer without a tool, answer with JSON only: {"response": "<your answer>"}.'
        elif self.choice != "required":
            how += f" Call the tool {self.choice}."
        return f"You can call the following tools: {listed}\n{how}"


def closed(schema):
    """A function's parameters as the answer is held to them: an object that declares its properties takes
    only those unless it says otherwise (`additionalProperties`), as OpenAI's strict mode reads every schema;
    one that declares none, or allows more, takes at most MAX_OPEN_KEYS besides. A model otherwise invents
    keys until max_tokens cuts the call (issue 53: 3 valid calls in 10 at max_tokens 64)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if isinstance(schema.get(key), dict):
            out[key] = closed(schema[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            out[key] = [closed(x) for x in schema[key]]
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {k: closed(v) for k, v in schema[key].items()}
    if schema.get("type") == "object" or "properties" in schema:
        if "additionalProperties" not in schema and schema.get("properties"):
            out["additionalProperties"] = False
        elif out.get("additionalProperties") is not False and "maxProperties" not in schema:
            out["maxProperties"] = len(schema.get("properties") or {}) + MAX_OPEN_KEYS
    return out


def parse(body: dict, form: str = "generic") -> ToolUse | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None where no tool may be called.
    `form`: the template's tool format (the node says which)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise ToolError("tools must be a list of at most 128 function tools", "tools")
    functions = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError('each tool must be {"type": "function", "function": {"name", "parameters"}}', "tools")
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"tool {f['name']}: parameters must be a JSON schema object", "tools")
        try:
            jsonvalue.check(params, f"tool {f['name']}: parameters")
        except ValueError as e:
            raise ToolError(str(e), "tools") from None
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"tool {f['name']}: description must be a string", "tools")
        functions.append({"name": f["name"], "description": desc, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tool names must be unique", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice in (None, "auto", "required", "none"):
        return None if choice == "none" else ToolUse(tuple(functions), choice or "auto", parallel, form)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    named = function.get("name") if isinstance(function, dict) else None
    if named not in names:
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": <one of the tools>}}', "tool_choice")
    return ToolUse(tuple(functions), named, parallel, form)


def history(message: dict, form: str = "generic") -> dict | None:
    """An earlier turn's tool calls or tool result as the node gets it: in the generic form, its content as the
    text the model sees; in a template's own format, the fields the template reads (ipc/chat.py's wire shape).
    None for a message that has neither."""
    if message.get("role") == "assistant" and message.get("tool_calls"):
        calls = []
        for c in message["tool_calls"]:
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ToolError("an assistant message's tool_calls must each have function.name", "messages")
            try:
                args = jsonvalue.loads(f.get("arguments") or "{}", f"tool call {f['name']}: arguments")
            except (TypeError, ValueError, AttributeError) as e:
                raise ToolError(f"tool call {f['name']}: arguments must be a JSON string ({e})", "messages") from None
            calls.append({"id": str(c.get("id") or ""), "name": f["name"], "arguments": args})
        if form in NATIVE:
            return {"content": message.get("content") or "", "tool_calls": [
                {**c, "arguments": json.dumps(c["arguments"], ensure_ascii=False)} for c in calls]}
        return {"content": json.dumps({"tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls]},
                                      ensure_ascii=False)}
    if message.get("role") == "tool":
        if form in NATIVE:
            return {"content": message.get("content"), **{k: str(message[k]) for k in ("tool_call_id", "name")
                                                          if message.get(k) is not None}}
        return {"content": json.dumps({"tool_response": {"tool_call_id": message.get("tool_call_id", ""),
                                                         "name": message.get("name", ""),
                                                         "content": message.get("content")}}, ensure_ascii=False)}
    return None


def answer(text: str, form: str = "generic") -> tuple[str | None, list[dict] | None]:
    """A finished, constrained answer -> (content, None) or (None, OpenAI's tool_calls); (text, None) where it
    is not the form (cut short by max_tokens)."""
    if form == "hermes":
        calls, n = _hermes(text)
        return (None, _openai(calls)) if calls and len(calls) == n else (text, None)
    if form == "llama3":
        c = _loaded(text.strip()) if text.lstrip().startswith("{") else None
        return (None, _openai([(c["name"], c["parameters"])])) if _is_call(c, "parameters") else (text, None)
    obj = _loaded(text)
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list) \
            and all(_is_call(c, "arguments") for c in obj["tool_calls"]):
        return None, _openai([(c["name"], c["arguments"]) for c in obj["tool_calls"]])
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return obj["response"], None
    return text, None


def cut_calls(text: str, form: str = "generic") -> list[dict] | None:
    """The calls an answer max_tokens cut short had completed (parallel calls, the last one cut): OpenAI's
    tool_calls for them, or None where not one is whole. The half call is dropped, never passed on."""
    if form == "hermes":
        calls, _ = _hermes(text)
    elif form == "llama3":
        return None  # one call an answer: cut is cut
    else:
        m = re.match(r'\s*\{\s*"tool_calls"\s*:\s*\[', text)
        calls, at, dec = [], m.end() if m else len(text), json.JSONDecoder()
        while m:
            at = len(text) - len(text[at:].lstrip(" \t\n\r,"))
            try:
                c, at = dec.raw_decode(text, at)
            except ValueError:
                break
            if not _is_call(c, "arguments"):
                break
            calls.append((c["name"], c["arguments"]))
    return _openai(calls) if calls else None


def settle(text: str, use: ToolUse | None, finish: str) -> tuple[str | None, list[dict] | None, str]:
    """A whole answer's text, calls and OpenAI finish reason. For a tools request: the calls it holds (finish
    `tool_calls`); where the budget cut it (`finish` "length") after whole calls, those calls, finish
    `tool_calls`: the cut one was a further parallel call that had only begun, and an agent reads `length` as
    a truncated answer (issue 70: 2 of 10 seeded answers of the packaged model ended so); cut before any whole
    call, the text without the call half made, `length`. Otherwise the text as it is."""
    if use is None:
        return text, None, finish
    if finish == "length":
        calls = cut_calls(text, use.form)
        return (None, calls, "tool_calls") if calls else (cut_text(text, use.form), None, finish)
    content, calls = answer(text, use.form)
    return content, calls, "tool_calls" if calls else finish


def cut_text(text: str, form: str = "generic") -> str | None:
    """An answer max_tokens cut short, as text a client may be shown: None where it was a call (half a call
    is no text), the text of a generic `{"response": ...}` answer as far as it went, a native form's text."""
    if form in NATIVE:
        return None if text.lstrip().startswith(("<tool_call>", "{")) else text
    m = re.match(r'\s*\{\s*"response"\s*:\s*"((?:[^"\\]|\\.)*)', text, re.S)
    if not m:
        return None
    raw = m.group(1)
    for end in range(len(raw), max(-1, len(raw) - 7), -1):  # a cut escape sequence: drop its start
        try:
            return json.loads(f'"{raw[:end]}"')
        except ValueError:
            continue
    return None


def _hermes(text: str) -> tuple[list[tuple[str, dict]], int]:
    """The whole `<tool_call>` blocks' calls (name, arguments), and how many blocks there were."""
    found = [_loaded(x) for x in _HERMES_CALL.findall(text)]
    return [(c["name"], c["arguments"]) for c in found if _is_call(c, "arguments")], len(found)


def _loaded(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _is_call(c, key: str) -> bool:
    return isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get(key), dict)


def _openai(calls: list[tuple[str, dict]]) -> list[dict]:
    return [{"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}} for name, args in calls]
