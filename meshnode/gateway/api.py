"""The OpenAI API in the node's terms, both ways, with no I/O: a request body becomes one typed `Submit`,
the node's events become OpenAI's response, stream chunks and error bodies.

Ranges and types of the numbers are the node's to judge (ipc/protocol.py, one home): values are passed
through as sent and a bad one comes back as the node's BAD_REQUEST, turned into a 400 here. What is
checked here is only what the OpenAI shape adds: `n`, message content parts, `stop` as a string,
`logprobs` / `top_logprobs`, `response_format`'s wrapping, and what the node does not do (tools, echo).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace

from ipc import protocol as P
from meshnode.core import reasons as R
from meshnode.core.types import SAMPLING_OPTIONS, ResponseFormat, Sampling
from meshnode.gateway import llamaext, reasoning, tools

FINISH = {R.EOS: "stop", R.STOP: "stop", R.LENGTH: "length"}  # others end a stream with an error chunk
# the node's rejection -> (HTTP status, OpenAI error type); Retry-After goes with the 429s
REJECTED = {R.REJECTED_QUEUE_FULL: 429, R.REJECTED_KV_BUDGET: 429, R.REJECTED_SCRATCH_BUDGET: 429,
            R.REJECTED_MEMORY_PRESSURE: 429, R.REJECTED_DRAINING: 503, R.REJECTED_ENGINE_UNAVAILABLE: 503,
            R.REJECTED_CONTEXT_TOO_LONG: 400, R.REJECTED_BAD_REQUEST: 400, R.REJECTED_RECIPE_MISMATCH: 400}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 501: "not_supported_error", 503: "server_error"}
RETRY_AFTER_S = 1
ARGUMENT_PIECE = 32  # characters of a streamed tool call's arguments a chunk
UNSUPPORTED = ("functions", "echo", "suffix", "best_of", "logit_bias")
MAX_CHOICES = 8  # `n`: choices one request may ask for (each a session of the node, admitted like any)


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str | None = None, extra: dict | None = None):
        """`kind`: the error's `type` where the status's is not it; `extra`: fields beside OpenAI's."""
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind, self.extra = kind, extra or {}

    @property
    def retry_after(self) -> int | None:
        return RETRY_AFTER_S if self.status == 429 else None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind or ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code, **self.extra}}


@dataclass
class Request:
    """One HTTP request in the node's terms, and what its answer must look like."""

    chat: bool
    submit: P.Submit
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs asked; else how many alternatives per token (0..20)
    model: str
    tools: tools.ToolUse | None = None  # the functions the answer may call (gateway/tools.py)
    n: int = 1  # choices: sessions of the same prompt, each its own draws (submits)
    llama: llamaext.Asked = llamaext.Asked()  # llama-server's own fields the request asks (gateway/llamaext.py)
    reasoning: str = "auto"  # what becomes of a thought in the answer (gateway/reasoning.py)

    def submits(self) -> list[P.Submit]:
        """One submit a choice: choice i draws with seed + i (greedy choices are the same answer, as OpenAI's)."""
        if self.n == 1:
            return [self.submit]
        s = self.submit
        return [replace(s, id=f"{s.id}-{i}", sampling=replace(s.sampling, seed=(s.sampling.seed + i) % (1 << 63)))
                for i in range(self.n)]


def parse(body, chat: bool, model: str, new_id, tool_format: str = "generic", defaults: dict | None = None,
          reasoning_format: str = "auto") -> Request:
    """A /v1/chat/completions or /v1/completions body -> Request; ApiError(400) for what cannot be served.
    `tool_format`: how the node's chat template has the model call tools (gateway/tools.py); `defaults`: the
    sampling options a request leaves out (`--sampling-defaults`, checked by `sampling_defaults`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key in UNSUPPORTED:
        if body.get(key):
            raise ApiError(400, f"{key} is not supported by this server", param=key)
    try:
        use = tools.parse(body, tool_format) if chat else None
    except tools.ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    if not chat and body.get("tools"):
        raise ApiError(400, "tools are for /v1/chat/completions", param="tools")
    _check_fields(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    top = _logprobs(body, chat)
    # OpenAI's names are the node's: passed as sent (the node judges them); absent or null, the gateway's
    # defaults, else the node's, but OpenAI's temperature (1) and a random seed, so that repeated requests
    # differ, as OpenAI's do
    given = {name: body[name] for name in SAMPLING_OPTIONS if body.get(name) is not None}
    sampling = Sampling(**{"temperature": 1.0, "seed": int.from_bytes(os.urandom(8), "little") >> 1,
                           **(defaults or {}), **given},
                        logprobs=0 if top is None else max(1, top))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    text, tokens, messages, listed = None, None, None, None
    fmt = _response_format(body)
    if chat:
        messages = _messages(body.get("messages"), tool_format)
        if use is not None:
            if fmt is not None:
                raise ApiError(400, "response_format cannot be combined with tools: a tools answer has its own form",
                               param="response_format")
            fmt = use.constraint()
            if use.form in tools.NATIVE:
                listed = use.wire()  # the template lists them its own way
            else:
                messages = with_tools(messages, use)
    else:
        text, tokens = _prompt(body.get("prompt"))
    # ignore_eos: llama-server's extension (benchmarks, load tests)
    # a completions prompt is the client's own template: special tokens it spells are parsed, as llama-server does
    # priority: vLLM's extension (lower first), for a node with --scheduling-policy priority
    # vLLM's chat options: the node checks them (a final assistant message continued, or a turn left unopened)
    turn = {k: body.get(k) for k in ("add_generation_prompt", "continue_final_message")} if chat else {}
    asked = llamaext.Asked.of(body)
    thinks = body.get("reasoning_format", reasoning_format)  # llama-server takes it per request too
    if thinks not in reasoning.FORMATS:
        raise ApiError(400, f"reasoning_format must be one of {', '.join(reasoning.FORMATS)}", param="reasoning_format")
    submit = P.Submit(new_id(), max_tokens, tokens, text, sampling, [], body.get("ignore_eos", False), None,
                      _stop(body.get("stop")), messages, fmt, special=text is not None, tools=listed,
                      priority=body.get("priority", 0), **turn, progress=stream and asked.node_progress,
                      echo=asked.verbose or (chat and use is None and reasoning.parses(thinks)))
    return Request(chat, submit, stream, bool(opts.get("include_usage")), top, body.get("model") or model, use,
                   body.get("n") or 1, asked, thinks)


def _check_fields(body: dict) -> None:
    """The fields that must be right before anything else is read, each named when it is not."""
    n = body.get("n")
    if n is not None and (type(n) is not int or not 1 <= n <= MAX_CHOICES):  # type: true == 1, and is no count
        raise ApiError(400, f"n must be an integer in [1, {MAX_CHOICES}]", param="n")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError(400, "model must be a string", param="model")
    for key, v in body.items():  # past 64 bits nothing reaches the node to judge it: say which field here
        if type(v) is int and not -(1 << 63) <= v < (1 << 64):
            raise ApiError(400, f"{key} is out of range (an integer past 64 bits)", param=key)


def _prompt(prompt) -> tuple[str | None, list[int] | None]:
    """A completions prompt: (text, None) or (None, token ids)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list: what the SDK sends for a single string sometimes
    if isinstance(prompt, str):
        return prompt, None
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, prompt
    else:
        raise ApiError(400, "prompt must be a string, or a list of token ids (one prompt per request)", param="prompt")


def with_tools(messages: list[dict], use: tools.ToolUse) -> list[dict]:
    """The tools in the system turn (the client's system message keeps its place, the tools after it)."""
    text = use.system_text()
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise ApiError(400, "logprobs must be a boolean", param="logprobs")
        if not body.get("logprobs"):
            if body.get("top_logprobs"):
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        top = body.get("top_logprobs") or 0
    else:
        top = body.get("logprobs")
        if top is None or top is False:
            return None
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= P.MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be an int in [0, {P.MAX_LOGPROBS}]", param="top_logprobs")
    return top


def _messages(v, tool_format: str) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for m in v:
        if not isinstance(m, dict):
            raise ApiError(400, "each message must be an object with role and content", param="messages")
        try:
            earlier = tools.history(m, tool_format)  # an earlier turn's tool calls or tool result
        except tools.ToolError as e:
            raise ApiError(400, str(e), param=e.param) from None
        content = m.get("content") if earlier is None else earlier.pop("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        out.append({"role": m.get("role"), "content": "" if content is None else content, **(earlier or {})})
    return out


def _stop(v) -> list:
    if v is None:
        return []
    return [v] if isinstance(v, str) else v  # a list of anything else: the node says what is wrong


def _response_format(body: dict) -> ResponseFormat | None:
    """OpenAI's `response_format` (text, json_object, json_schema with its `json_schema.schema`; llama-server's
    json_object with a `schema`), or llama-server's `json_schema` and `grammar` fields."""
    if body.get("grammar") is not None:
        return ResponseFormat("grammar", body["grammar"])
    if body.get("json_schema") is not None:
        return ResponseFormat("json_schema", json.dumps(body["json_schema"]))
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_schema", json.dumps(rf["schema"])) if "schema" in rf else ResponseFormat("json_object")
    if kind == "json_schema" and isinstance(rf.get("json_schema"), dict) and isinstance(rf["json_schema"].get("schema"), dict):
        return ResponseFormat("json_schema", json.dumps(rf["json_schema"]["schema"]))
    raise ApiError(400, "response_format must be {type: text}, {type: json_object} or {type: json_schema, "
                        "json_schema: {name, schema}}", param="response_format")


# -- the node's answers -> OpenAI's -------------------------------------------------------------------
def rejection(ev: dict) -> ApiError:
    """A `rejected` or `error` event -> the HTTP error."""
    if ev["event"] == "error":
        status = {R.BAD_REQUEST: 400, R.TOO_LARGE: 413}.get(ev.get("code"), 500)
        return ApiError(status, ev.get("detail", ""), code=ev.get("code"))
    if ev["reason"] == R.REJECTED_CONTEXT_TOO_LONG:  # llama-server's body, which its clients read
        return ApiError(400, ev.get("detail", ""), code=ev["reason"], kind="exceed_context_size_error",
                        extra=llamaext.context_error(ev))
    return ApiError(REJECTED.get(ev["reason"], 500), ev.get("detail", ""), code=ev["reason"])


def usage(done: dict) -> dict:
    u = done["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)}}


def finish_error(done: dict) -> ApiError | None:
    """A `done` that is no normal finish (engine error, cancelled, drained) -> the error to report."""
    if done["reason"] in FINISH:
        return None
    # a queued request a better-priority one displaced: the node's rejection, as if it had come at once
    status = REJECTED.get(done["reason"]) or (
        503 if done["reason"] in (R.DRAINED, R.ENGINE_ERROR) else 400 if done["reason"] == R.BAD_REQUEST else 500)
    return ApiError(status,
                    done.get("detail") or f"the generation ended with {done['reason']}", code=done["reason"])


class Answer:
    """One request's OpenAI answer, built from the node's events as they come: stream chunks, or the
    whole response at the end. `piece(token) -> bytes` names tokens for logprobs (the model's vocab);
    `fingerprint`, the node's recipe, is OpenAI's `system_fingerprint`: what produced the answer."""

    def __init__(self, req: Request, piece=None, fingerprint: str = "", index: int = 0):
        self.req, self.piece, self.fingerprint, self.index = req, piece, fingerprint, index
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + req.submit.id
        self.created = int(time.time())
        self.split = reasoning.Split()  # the answer's text (and its thought, where one is parsed)
        self.logprobs: list[dict] = []  # chat: OpenAI's content entries; completions: (token, lp, top)
        self.sent_role = False
        self.running, self.prompt = llamaext.Running(req.llama), None

    def admitted(self, ev: dict) -> None:
        self.prompt = ev.get("prompt")  # the prompt's ids, where the request asked `verbose` or parses thoughts
        self.split = reasoning.split_of(self.req, self.prompt, self.piece)

    @staticmethod
    def _delta(thought: str, text: str) -> dict:
        """A chat delta's fields for a piece of the answer: its thought as reasoning_content."""
        return {**({"reasoning_content": thought} if thought else {}), **({"content": text} if text or not thought
                                                                           else {})}

    def progress(self, ev: dict) -> list[dict]:
        """A `progress` event -> llama-server's prompt_progress chunk, where the request asked it."""
        p = self.running.progress(ev)
        return [{**self._base(True), "choices": [], "prompt_progress": p}] if p else []

    closing = b"data: [DONE]\n\n"  # what ends the stream after the last chunk

    def start(self) -> list[dict]:
        """The chunks a stream opens with before any token (a chat's role chunk waits for the first)."""
        return []

    def error(self, err: ApiError) -> list[dict]:
        """What ends a stream that cannot finish: the error body as the last chunk."""
        return [err.body()]

    @staticmethod
    def frame(chunks: list[dict]) -> bytes:
        """Server-sent events for the chunks, written at once: one wake-up of the client, one syscall."""
        return b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks)

    def _base(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.req.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model,
                "system_fingerprint": self.fingerprint}

    def tokens(self, ev: dict) -> list[dict]:
        """A `tokens` event -> the stream chunks it makes (kept for the whole answer as well)."""
        thought, text = self.split.feed(ev["text"])
        lps = self._logprobs(ev) if self.req.top_logprobs is not None else None
        if lps:
            self.logprobs += lps
        if not self.req.stream:
            return []
        out = []
        if self.req.chat and not self.sent_role:
            self.sent_role = True
            out.append(self._chunk({"role": "assistant", "content": None}, None, None))
        timed = self.running.token(len(ev["tokens"]))
        if (thought or text or lps) and self.req.tools is None:  # a tools answer is JSON: told at its end
            out.append(self._chunk(self._delta(thought, text) if self.req.chat else text, lps, None))
            if timed:
                out[-1]["timings"] = timed
        return out

    def _chunk(self, delta, lps, finish) -> dict:
        choice = {"index": self.index, ("delta" if self.req.chat else "text"): delta,
                  "logprobs": self._wrap(lps) if lps else None, "finish_reason": finish}
        return {**self._base(True), "choices": [choice], **({"usage": None} if self.req.include_usage else {})}

    def _logprobs(self, ev: dict) -> list:
        if self.piece is None:
            raise ApiError(400, "logprobs need the model's vocabulary, which this gateway could not read "
                                "(run it where the model file is, or give --model)", param="logprobs")
        out = []
        for e in ev.get("logprobs") or []:
            # a constrained row's alternatives past the allowed tokens are at -inf: JSON has no such number
            top = [t for t in e["top"][:self.req.top_logprobs] if math.isfinite(t["logprob"])]
            if self.req.chat:
                out.append({**self._token(e["token"], e["logprob"]), "top_logprobs": [
                    self._token(t["token"], t["logprob"]) for t in top]})
            else:
                out.append((self._name(e["token"]), e["logprob"], {self._name(t["token"]): t["logprob"] for t in top}))
        return out

    def _name(self, token: int) -> str:
        return self.piece(token).decode("utf-8", "replace")

    def _token(self, token: int, lp: float) -> dict:
        raw = self.piece(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}

    def _wrap(self, lps: list):
        if self.req.chat:
            return {"content": lps}
        return {"tokens": [t for t, _, _ in lps], "token_logprobs": [lp for _, lp, _ in lps],
                "top_logprobs": [top for _, _, top in lps], "text_offset": []}

    def end(self, done: dict, with_usage: bool = True) -> list[dict]:
        """The `done` event -> the last stream chunks (finish reason, and usage unless the caller sends the
        choices' together), or the whole response."""
        finish = FINISH[done["reason"]]
        if self.req.tools is not None:
            return self._tools_end(done, finish, with_usage)
        held = self.split.end()  # what the split held back (a tag's possible beginning)
        if self.req.stream:
            out = [self._chunk(self._delta(*held), None, None)] if any(held) else []
            return self._last(done, [*out, self._chunk({} if self.req.chat else "", None, finish)], with_usage)
        text, thought = self.split.content, self.split.reasoning
        lps = self._wrap(self.logprobs) if self.req.top_logprobs is not None else None
        msg = {"role": "assistant", "content": text, **({"reasoning_content": thought} if thought else {})}
        choice = ({"index": self.index, "message": msg, "logprobs": lps, "finish_reason": finish}
                  if self.req.chat else {"index": self.index, "text": text, "logprobs": lps, "finish_reason": finish})
        return [self._whole(done, [choice])]

    def _whole(self, done: dict, choices: list) -> dict:
        """The whole response (not streamed), with llama-server's timings, and its __verbose where asked."""
        out = {**self._base(False), "choices": choices, "usage": usage(done), "timings": llamaext.final_timings(done)}
        if self.req.llama.verbose and self.prompt is not None and self.piece is not None:
            out["__verbose"] = {"prompt": b"".join(map(self.piece, self.prompt)).decode("utf-8", "replace")}
        return out

    def _last(self, done: dict, out: list[dict], with_usage: bool) -> list[dict]:
        """A stream's last chunks: its finish, then the usage where asked, both with llama-server's timings."""
        out[-1]["timings"] = timings = llamaext.final_timings(done)
        if self.req.include_usage and with_usage:
            out.append({**self._base(True), "choices": [], "usage": usage(done), "timings": timings})
        return out

    def _tools_end(self, done: dict, finish: str, with_usage: bool = True) -> list[dict]:
        """A tools answer, parsed once whole: `tool_calls` (finish `tool_calls`) or the response's text.
        Streamed as OpenAI streams calls: per call its index, id, type and name first, then its arguments in
        fragments."""
        # cut by max_tokens: no half call passes on, as text or as a call (tools.settle)
        content, calls, finish = tools.settle(self.split.content, self.req.tools, finish)
        if not self.req.stream:
            msg = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            lps = self._wrap(self.logprobs) if self.req.top_logprobs is not None else None
            choice = {"index": self.index, "message": msg, "logprobs": lps, "finish_reason": finish}
            return [self._whole(done, [choice])]
        out = [] if self.sent_role else [self._chunk({"role": "assistant", "content": None}, None, None)]
        if content:
            out.append(self._chunk({"content": content}, None, None))
        for i, c in enumerate(calls or ()):
            f = c["function"]
            out.append(self._chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                                    "function": {"name": f["name"], "arguments": ""}}]}, None, None))
            args = f["arguments"]
            for k in range(0, len(args), ARGUMENT_PIECE):
                out.append(self._chunk({"tool_calls": [{"index": i, "function": {
                    "arguments": args[k:k + ARGUMENT_PIECE]}}]}, None, None))
        return self._last(done, [*out, self._chunk({}, None, finish)], with_usage)
