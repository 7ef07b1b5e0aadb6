"""OpenAI's Responses API (`/v1/responses`) in the node's terms, with no I/O: the request becomes a chat
completions body (as llama-server converts it, server-chat.cpp), parsed by api.parse like any chat, and
the node's events become a response object or the Responses stream's typed events.

Stateless, as llama-server: `previous_response_id`, `conversation` and `background` are refused with a 400
that says to send the whole input; nothing is stored. Output is `message` items (`output_text`) and
`function_call` items; a budget cut is `status: incomplete` with `incomplete_details.reason:
max_output_tokens`, as OpenAI reports it (llama-server says `completed`).
"""
from __future__ import annotations

import json
import time

from meshnode.gateway import api, llamaext, reasoning, tools

STATEFUL = ("previous_response_id", "conversation", "background", "prompt")
# the Responses fields with no chat completions meaning here: accepted and dropped (what the node never
# keeps, or what only changes OpenAI's billing, storage or routing)
DROPPED = ("store", "metadata", "truncation", "reasoning", "include", "user", "service_tier", "stream_options",
           "prompt_cache_key", "safety_identifier", "max_tool_calls", "top_logprobs_include")
ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "tool_choice", "tools", "parallel_tool_calls",
          "metadata")


def to_chat(body) -> dict:
    """A Responses request body -> the chat completions body it means; ApiError(400) where it cannot."""
    if not isinstance(body, dict):
        raise api.ApiError(400, "the request body must be a JSON object")
    for key in STATEFUL:
        if body.get(key):
            raise api.ApiError(400, f"{key} is not supported: this server keeps no responses; send the whole "
                                    "conversation as input", param=key)
    if "input" not in body:
        raise api.ApiError(400, "input is required", param="input")
    chat = {k: v for k, v in body.items() if k not in (*DROPPED, "input", "instructions", "max_output_tokens",
                                                        "text", "tools", "tool_choice")}
    if body.get("top_logprobs"):
        raise api.ApiError(400, "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
                           param="top_logprobs")
    chat.pop("top_logprobs", None)
    messages = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise api.ApiError(400, "instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    messages += _messages(body["input"])
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    return chat


def _messages(items) -> list[dict]:
    """`input` (a string, or a list of items) -> chat messages: an assistant's message and calls that follow
    each other are one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise api.ApiError(400, "input must be a string or a list of items", param="input")
    out: list[dict] = []
    for item in items:
        if not isinstance(item, dict):
            raise api.ApiError(400, "each input item must be an object", param="input")
        kind = item.get("type", "message")
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise api.ApiError(400, "a message's role must be user, system, developer or assistant",
                                   param="input")
            text = _text(item.get("content"))
            if role == "assistant" and last is not None and "tool_calls" not in last:
                last["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise api.ApiError(400, "a function_call item needs call_id, name and arguments (strings)",
                                   param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if last is None:
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise api.ApiError(400, "a function_call_output item needs its call_id", param="input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output)})
        else:
            raise api.ApiError(400, f"input items of type {kind!r} are not supported (message, function_call, "
                                    "function_call_output)", param="input")
    return out


def _text(content) -> str:
    """A message's content: a string, or parts of text (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise api.ApiError(400, "only text content is supported (a string, or input_text / output_text parts)",
                       param="input")


def _tools(listed) -> list[dict]:
    if not isinstance(listed, list):
        raise api.ApiError(400, "tools must be a list", param="tools")
    out = []
    for t in listed:
        if not isinstance(t, dict) or t.get("type") != "function":
            raise api.ApiError(400, "only function tools are supported", param="tools")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # "auto", "none", "required", or what gateway/tools.py refuses


def _format(fmt) -> dict:
    """`text.format` -> chat's `response_format`."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", ""), "schema": fmt.get("schema")}}
    return fmt  # text, json_object, or what api.parse refuses


def usage(done: dict) -> dict:
    u = done["usage"]
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


class ResponseAnswer:
    """One /v1/responses answer built from the node's events: the stream's events as they come (each with
    its `type` and `sequence_number`), or the response object at the end. The same calls as api.Answer
    (start, tokens, end, error, frame), so the gateway streams either the same way."""

    closing = b""  # the Responses stream ends with its response.completed event, no [DONE]

    def __init__(self, req: api.Request, body: dict, fingerprint: str = "", piece=None):
        self.req, self.fingerprint, self.piece = req, fingerprint, piece
        self.id, self.msg_id = "resp_" + req.submit.id, "msg_" + req.submit.id
        self.created = int(time.time())
        self.echo = {k: body.get(k) for k in ECHOED}
        self.split = reasoning.Split()  # the answer's text (and its thought, where one is parsed)
        self.seq = 0
        self.opened = False  # the message item and its text part announced (a streamed text answer)
        self.running = llamaext.Running(req.llama)
        self.rs_id = "rs_" + req.submit.id
        self.at = 0  # the message's output index: 1 behind a reasoning item
        self.thinking_open = False  # a streamed reasoning item announced and not done yet

    def admitted(self, ev: dict) -> None:
        self.split = reasoning.split_of(self.req, ev.get("prompt"), self.piece)

    def progress(self, ev: dict) -> list[dict]:
        """llama-server's prompt_progress, on a `response.in_progress` event as it sends it."""
        p = self.running.progress(ev)
        return [self._event("response.in_progress", response=self._response("in_progress", []),
                            prompt_progress=p)] if p else []

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _response(self, status: str, output: list, done: dict | None = None) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.req.model, "output": output, "error": None, "incomplete_details": None,
               "text": {"format": {"type": "text"}}, **self.echo, "usage": usage(done) if done else None}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
        return out

    def start(self) -> list[dict]:
        r = self._response("in_progress", [])
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def tokens(self, ev: dict) -> list[dict]:
        pieces = self.split.feed(ev["text"])
        timed = self.running.token(len(ev["tokens"]))
        if self.req.tools is not None:
            return []  # a tools answer is JSON: told at its end
        return self._deltas(*pieces, timed)

    def _deltas(self, thought: str, text: str, timed: dict | None = None) -> list[dict]:
        """A thought's and a text's pieces as the stream's events: a reasoning item's, then the message's."""
        if not self.req.stream:
            return []
        out = []
        if thought:
            if not self.thinking_open:
                self.thinking_open, self.at = True, 1
                out.append(self._event("response.output_item.added", output_index=0,
                                       item=self._reasoning("", "in_progress")))
            out.append(self._event("response.reasoning_text.delta", item_id=self.rs_id, output_index=0,
                                   content_index=0, delta=thought))
        if text:
            out += self._thought_done() + ([] if self.opened else self._open())
            out.append(self._event("response.output_text.delta", item_id=self.msg_id, output_index=self.at,
                                   content_index=0, delta=text, logprobs=[], **({"timings": timed} if timed else {})))
        return out

    def _reasoning(self, text: str, status: str = "completed") -> dict:
        return {"type": "reasoning", "id": self.rs_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}

    def _thought_done(self) -> list[dict]:
        """A streamed reasoning item's last events, once the message begins (or the answer ends)."""
        if not self.thinking_open:
            return []
        self.thinking_open, text = False, self.split.reasoning
        return [self._event("response.reasoning_text.done", item_id=self.rs_id, output_index=0, content_index=0,
                            text=text),
                self._event("response.output_item.done", output_index=0, item=self._reasoning(text))]

    def _open(self) -> list[dict]:
        self.opened = True
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
        return [self._event("response.output_item.added", output_index=self.at, item=item),
                self._event("response.content_part.added", item_id=self.msg_id, output_index=self.at, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _message(self, text: str) -> dict:
        return {"type": "message", "id": self.msg_id, "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def end(self, done: dict, with_usage: bool = True) -> list[dict]:
        """The `done` event -> the last events of the stream, or [the response]."""
        finish = api.FINISH[done["reason"]]
        streamed = self._deltas(*self.split.end())
        text, calls, finish = tools.settle(self.split.content, self.req.tools, finish)
        thought = self.split.reasoning
        output = [self._reasoning(thought)] if thought else []
        output += [self._message(text or "")] if text or not calls else []
        output += [{"type": "function_call", "id": "fc_" + c["id"], "call_id": c["id"], "status": "completed",
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls or ()]
        status = "incomplete" if finish == "length" else "completed"
        whole = self._response(status, output, done)
        if not self.req.stream:
            return [whole]
        out = streamed + self._thought_done()
        for i, item in enumerate(output):
            if item["type"] != "reasoning":  # told as it streamed
                out += self._told(i, item)
        return out + [self._event(f"response.{status}", response=whole, timings=llamaext.final_timings(done))]

    def _told(self, i: int, item: dict) -> list[dict]:
        """The events that finish output item i (announcing it first where the tokens did not)."""
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            if not (i == self.at and self.opened):
                out += self._open()
            out += [self._event("response.output_text.done", item_id=self.msg_id, output_index=i, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=self.msg_id, output_index=i, content_index=0,
                                part=part)]
        else:
            out.append(self._event("response.output_item.added", output_index=i,
                                   item={**item, "status": "in_progress", "arguments": ""}))
            args = item["arguments"]
            out += [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                delta=args[k:k + api.ARGUMENT_PIECE]) for k in range(0, len(args), api.ARGUMENT_PIECE)]
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                   name=item["name"], arguments=args))
        return out + [self._event("response.output_item.done", output_index=i, item=item)]

    def error(self, err: api.ApiError) -> list[dict]:
        """A stream that cannot finish: OpenAI's `error` event, then `response.failed`."""
        failed = {**self._response("failed", []), "error": {"code": err.code or "server_error", "message": err.message}}
        return [self._event("error", code=err.code, message=err.message, param=err.param),
                self._event("response.failed", response=failed)]

    @staticmethod
    def frame(events: list[dict]) -> bytes:
        """Server-sent events, each named by its type (`event:` then `data:`), written at once."""
        return b"".join(b"event: " + e["type"].encode() + b"\ndata: " +
                        json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)
