"""A submit's chat parts on the wire: `messages` (with tool calls and tool results) and `tools`, checked and
put in the shapes the model's chat template reads (Hugging Face's `apply_chat_template` conventions).

On the wire every tool call is flat, `{id, name, arguments}`, and every tool `{name, description,
parameters}`, with `arguments` and `parameters` as JSON text: a JSON schema may nest deeper and hold keys
msgpack's limits refuse. The template gets `tool_calls: [{id, type: "function", function: {name, arguments:
<object>}}]` and `tools: [{type: "function", function: {name, description, parameters: <object>}}]`, as
llama-server hands them to templates that read arguments as objects (Qwen2.5's, Llama 3.1's). Raises
ValueError with the words the client gets.
"""
from __future__ import annotations

from ipc import jsonvalue

MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64
MAX_NAME_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")  # a role reaches the template as is: no free text


def messages(v, max_chars: int) -> list[dict]:
    ok = isinstance(v, list) and 1 <= len(v) <= MAX_MESSAGES and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v)
    if not ok:
        raise ValueError(f"messages must be a list of 1 to {MAX_MESSAGES} maps with string role and content")
    bad = next((m["role"] for m in v if m["role"] not in ROLES), None)
    if bad is not None:
        raise ValueError(f"role {bad!r} is not one of {', '.join(ROLES)}")
    out, chars = [], 0
    for m in v:
        msg = {"role": m["role"], "content": m["content"]}
        chars += len(m["content"]) + len(m["role"])
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise ValueError("tool_calls belong to assistant messages")
            msg["tool_calls"] = [_call(c) for c in _listed(m["tool_calls"], MAX_TOOL_CALLS, "tool_calls")]
            chars += sum(len(c["name"]) + len(c.get("arguments", "")) + len(c.get("id", "")) for c in m["tool_calls"])
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if m["role"] != "tool" or not isinstance(m[key], str) or len(m[key]) > MAX_NAME_CHARS:
                    raise ValueError(f"{key} is a string of at most {MAX_NAME_CHARS} characters, on tool messages")
                msg[key] = m[key]
        out.append(msg)
    if chars > max_chars:
        raise ValueError(f"messages hold more than {max_chars} characters")
    return out


def tools(v, max_chars: int) -> list[dict]:
    out, chars = [], 0
    for t in _listed(v, MAX_TOOLS, "tools"):
        name, params, desc = t.get("name"), t.get("parameters", "{}"), t.get("description", "")
        if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS and isinstance(desc, str)):
            raise ValueError(f"each tool needs a name of 1 to {MAX_NAME_CHARS} characters and a string description")
        schema = _json(params, f"tool {name}: parameters")
        if not isinstance(schema, dict):
            raise ValueError(f"tool {name}: parameters must be a JSON schema object")
        chars += len(name) + len(desc) + len(params)  # an absent description is "", as llama-server lists it
        out.append({"type": "function", "function": {"name": name, "description": desc, "parameters": schema}})
    if chars > max_chars:
        raise ValueError(f"tools hold more than {max_chars} characters")
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    return out


def _listed(v, limit: int, what: str) -> list[dict]:
    if not (isinstance(v, list) and 1 <= len(v) <= limit and all(isinstance(x, dict) for x in v)):
        raise ValueError(f"{what} must be a list of 1 to {limit} maps")
    return v


def _call(c: dict) -> dict:
    name, args, cid = c.get("name"), c.get("arguments", "{}"), c.get("id", "")
    if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS and isinstance(cid, str)
            and len(cid) <= MAX_NAME_CHARS and isinstance(args, str)):
        raise ValueError(f"each tool call needs a name of 1 to {MAX_NAME_CHARS} characters, a string id and "
                         "arguments as JSON text")
    obj = _json(args, f"tool call {name}: arguments")
    if not isinstance(obj, dict):
        raise ValueError(f"tool call {name}: arguments must be a JSON object")
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": obj}}


def _json(text: str, what: str):
    return jsonvalue.loads(text, what)
