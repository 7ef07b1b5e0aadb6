"""OpenAI tool calling in the node's terms, with no I/O: the tools go into the system turn, the answer is
constrained from its first token to a JSON form that is either tool calls whose arguments match each
function's JSON schema or (with `tool_choice: auto`) a plain response, and the finished text becomes
OpenAI's `tool_calls`.

The form is this gateway's own generic one (llama-server's generic handler is the model: a JSON object,
the tools listed in the system turn), used for every model: a template's own tool syntax differs from
family to family, while a constrained JSON answer parses on any model, a 135M one included:
  {"tool_calls": [{"name": "<function>", "arguments": {...}}, ...]}    or    {"response": "<text>"}
Earlier turns are given back in the same form: an assistant message's `tool_calls` as that JSON, a `tool`
message's result as {"tool_response": {"tool_call_id", "name", "content"}}.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass


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

    def schema(self) -> dict:
        """The JSON schema every answer of this request matches."""
        allowed = [f for f in self.functions if self.choice in ("auto", "required") or f["name"] == self.choice]
        items = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in allowed]
        calls = {"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1,
            **({} if self.parallel else {"maxItems": 1})}}, "required": ["tool_calls"], "additionalProperties": False}
        if self.choice != "auto":
            return calls
        text = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
        return {"anyOf": [calls, text]}

    def system_text(self) -> str:
        listed = json.dumps([{"name": f["name"], "description": f.get("description", ""),
                              "parameters": f["parameters"]} for f in self.functions], ensure_ascii=False)
        how = ('To call tools, answer with JSON only: {"tool_calls": [{"name": "<tool name>", "arguments": '
               '{<arguments matching its parameters>}}]}.')
        if self.choice == "auto":
            how += ' To answer without a tool, answer with JSON only: {"response": "<your answer>"}.'
        elif self.choice != "required":
            how += f" Call the tool {self.choice}."
        return f"You can call the following tools: {listed}\n{how}"


def parse(body: dict) -> ToolUse | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None where no tool may be called."""
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
        functions.append({"name": f["name"], "description": str(f.get("description") or ""), "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tool names must be unique", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice in (None, "auto", "required", "none"):
        return None if choice == "none" else ToolUse(tuple(functions), choice or "auto", parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        else None
    if named not in names:
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": <one of the tools>}}', "tool_choice")
    return ToolUse(tuple(functions), named, parallel)


def history(message: dict) -> str | None:
    """An earlier turn's tool calls or tool result as the text the model sees (the generic form); None for
    a message that has neither."""
    if message.get("role") == "assistant" and message.get("tool_calls"):
        calls = []
        for c in message["tool_calls"]:
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ToolError("an assistant message's tool_calls must each have function.name", "messages")
            try:
                args = json.loads(f.get("arguments") or "{}")
            except (TypeError, ValueError):
                raise ToolError(f"tool call {f['name']}: arguments must be a JSON string", "messages") from None
            calls.append({"name": f["name"], "arguments": args})
        return json.dumps({"tool_calls": calls}, ensure_ascii=False)
    if message.get("role") == "tool":
        return json.dumps({"tool_response": {"tool_call_id": message.get("tool_call_id", ""),
                                             "name": message.get("name", ""), "content": message.get("content")}},
                          ensure_ascii=False)
    return None


def answer(text: str) -> tuple[str | None, list[dict] | None]:
    """A finished, constrained answer -> (content, None) or (None, OpenAI's tool_calls); (text, None) where it
    is not the form (cut short by max_tokens)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text, None
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        return None, [{"id": "call_" + secrets.token_hex(12), "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                      for c in obj["tool_calls"]]
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return obj["response"], None
    return text, None
