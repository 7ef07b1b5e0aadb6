"""Anthropic's Messages API (`/v1/messages`) in the node's terms, with no I/O: the request becomes a chat
completions body (as llama-server converts it), parsed by api.parse like any chat, and the node's events
become a message object or the Messages stream's named events.

What is served: `system` (a string or text blocks), `messages` of `user` and `assistant` turns whose content
is a string or blocks of `text`, `tool_use` (an assistant's call) and `tool_result` (a user's answer to one);
`max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `tools`
(`{name, description, input_schema}`) with `tool_choice` (`auto`, `any`, `tool`, `none`;
`disable_parallel_tool_use`); `metadata` is accepted and dropped. A budget cut is `stop_reason:
max_tokens`, a call `tool_use`, a stop string `stop_sequence`, the model's end `end_turn`. Images, documents
and extended thinking are refused with a 400 naming them. Errors take Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`).
"""
from __future__ import annotations

import json

from meshnode.gateway import api, reasoning, tools

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
STOP = {"length": "max_tokens", "stop": "end_turn"}


def error_body(e: api.ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def to_chat(body) -> dict:
    """A Messages request body -> the chat completions body it means; ApiError(400) where it cannot."""
    if not isinstance(body, dict):
        raise api.ApiError(400, "the request body must be a JSON object")
    mt = body.get("max_tokens")
    if type(mt) is not int or mt < 1:
        raise api.ApiError(400, "max_tokens: required, an integer of at least 1", param="max_tokens")
    if body.get("thinking"):
        raise api.ApiError(400, "thinking is not supported by this server", param="thinking")
    chat = {"max_tokens": mt, "stream": body.get("stream", False), "messages": _system(body.get("system"))}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise api.ApiError(400, "stop_sequences must be a list of strings", param="stop_sequences")
        chat["stop"] = stops
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise api.ApiError(400, "messages: required, a non-empty list", param="messages")
    for m in msgs:
        chat["messages"] += _turn(m)
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice))
    return chat


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": _text_of(system, "system")}]


def _text_of(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                        and isinstance(b.get("text"), str) for b in blocks):
        return "".join(b["text"] for b in blocks)
    raise api.ApiError(400, f"{where}: only text content is supported here (a string or text blocks)", param=where)


def _turn(m) -> list[dict]:
    """One Messages turn -> chat messages: a user's tool_result blocks are tool messages, an assistant's
    tool_use blocks its tool_calls."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise api.ApiError(400, "messages: each is an object whose role is user or assistant", param="messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise api.ApiError(400, "messages: content is a string or a list of blocks", param="messages")
    out, text, calls = [], [], []
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                    and isinstance(b.get("input"), dict)):
                raise api.ApiError(400, "a tool_use block needs id, name and input (an object)", param="messages")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise api.ApiError(400, "a tool_result block needs its tool_use_id", param="messages")
            result = _text_of(b.get("content", ""), "tool_result content")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": ("error: " + result) if b.get("is_error") else result})
        else:
            raise api.ApiError(400, f"messages: a {kind!r} block is not supported in a {role} turn here (text, "
                                    "tool_use from the assistant, tool_result from the user)", param="messages")
    if text or calls or not out:
        msg = {"role": role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(listed) -> list[dict]:
    if not isinstance(listed, list):
        raise api.ApiError(400, "tools must be a list", param="tools")
    out = []
    for t in listed:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            raise api.ApiError(400, "each tool is {name, description, input_schema} (client tools only)",
                               param="tools")
        f = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("description") is not None:
            f["description"] = t["description"]
        out.append({"type": "function", "function": f})
    return out


def _tool_choice(choice) -> dict:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise api.ApiError(400, "tool_choice is {type: auto | any | tool | none}", param="tool_choice")
    out = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)
           or {"type": "function", "function": {"name": choice.get("name")}}}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def usage(done: dict) -> dict:
    u = done["usage"]
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": u.get("cached_tokens", 0), "cache_creation_input_tokens": 0}


class MessagesAnswer:
    """One /v1/messages answer built from the node's events: the stream's named events as they come, or the
    message object at the end. The same calls as api.Answer (start, admitted, progress, tokens, end, error,
    frame)."""

    closing = b""  # the stream ends with its message_stop event

    def __init__(self, req: api.Request, piece=None):
        self.req, self.piece = req, piece
        self.id = "msg_" + req.submit.id
        self.blocks: list[str] = []  # the streamed blocks' types, in order; the last one is open until the end
        self.split = reasoning.Split()  # the answer's text (and its thought, where one is parsed)

    def admitted(self, ev: dict) -> None:
        self.split = reasoning.split_of(self.req, ev.get("prompt"), self.piece)

    def progress(self, ev: dict) -> list[dict]:
        return []  # Anthropic's stream has no such event

    def _message(self, content: list, stop_reason, stop_sequence, use: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": use}

    def start(self) -> list[dict]:
        zero = {"input_tokens": 0, "output_tokens": 0}
        return [{"type": "message_start", "message": self._message([], None, None, zero)}, {"type": "ping"}]

    def tokens(self, ev: dict) -> list[dict]:
        pieces = self.split.feed(ev["text"])
        if self.req.tools is not None:
            return []  # a tools answer is JSON: told at its end
        return self._deltas(*pieces)

    def _deltas(self, thought: str, text: str) -> list[dict]:
        """A thought's and a text's pieces as the stream's deltas (a thinking block, then the text block)."""
        if not self.req.stream:
            return []
        out = []
        for kind, piece in (("thinking", thought), ("text", text)):
            if piece:
                out += self._block(kind)
                field = "thinking" if kind == "thinking" else "text"
                out.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                            "delta": {"type": f"{kind}_delta", field: piece}})
        return out

    def _block(self, kind: str) -> list[dict]:
        """The block of `kind` open for deltas: the open one, or a new one after closing it."""
        if self.blocks and self.blocks[-1] == kind:
            return []
        out = [{"type": "content_block_stop", "index": len(self.blocks) - 1}] if self.blocks else []
        self.blocks.append(kind)
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
            {"type": "text", "text": ""}
        return out + self._open(len(self.blocks) - 1, block)

    @staticmethod
    def _open(i: int, block: dict) -> list[dict]:
        return [{"type": "content_block_start", "index": i, "content_block": block}]

    def end(self, done: dict, with_usage: bool = True) -> list[dict]:
        """The `done` event -> the stream's last events, or [the message]."""
        finish = api.FINISH[done["reason"]]
        streamed = self._deltas(*self.split.end())
        text, calls, finish = tools.settle(self.split.content, self.req.tools, finish)
        thought = self.split.reasoning
        content = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
        content += [{"type": "text", "text": text}] if text or not calls else []
        content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                     "input": json.loads(c["function"]["arguments"] or "{}")} for c in calls or ()]
        matched = done.get("stop") or None  # the node names the stop string that ended it
        if calls:
            reason = "tool_use"
        elif matched:
            reason = "stop_sequence"
        else:
            reason = STOP[finish]
        use = usage(done)
        if not self.req.stream:
            return [self._message(content, reason, matched if reason == "stop_sequence" else None, use)]
        # the blocks streamed so far are the first of `content` (a thinking block, then the text): the last one
        # closes, the rest are told whole (an empty text, a tools request's words answer, its calls)
        out = streamed + ([{"type": "content_block_stop", "index": len(self.blocks) - 1}] if self.blocks else [])
        for i, block in enumerate(content[len(self.blocks):], start=len(self.blocks)):
            if block["type"] == "text":
                out += self._open(i, {"type": "text", "text": ""})
                if block["text"]:
                    out.append({"type": "content_block_delta", "index": i,
                                "delta": {"type": "text_delta", "text": block["text"]}})
            else:
                out += self._open(i, {**block, "input": {}})
                args = json.dumps(block["input"], ensure_ascii=False)
                out += [{"type": "content_block_delta", "index": i,
                         "delta": {"type": "input_json_delta", "partial_json": args[k:k + api.ARGUMENT_PIECE]}}
                        for k in range(0, len(args), api.ARGUMENT_PIECE)]
            out.append({"type": "content_block_stop", "index": i})
        return out + [{"type": "message_delta",
                       "delta": {"stop_reason": reason,
                                 "stop_sequence": matched if reason == "stop_sequence" else None},
                       "usage": use},
                      {"type": "message_stop"}]

    def error(self, err: api.ApiError) -> list[dict]:
        return [error_body(err)]

    @staticmethod
    def frame(events: list[dict]) -> bytes:
        """Server-sent events, each named by its type (`event:` then `data:`)."""
        return b"".join(b"event: " + e["type"].encode() + b"\ndata: " +
                        json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)
