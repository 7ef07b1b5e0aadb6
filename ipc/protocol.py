"""Every client-link message, with its validation, in one place.

Client link (docs/protocol.md, version 1): two frames `[b"MN1", msgpack map]`.
The engine link's messages are in ipc/link.py.

Decoding never trusts input: msgpack runs with explicit size limits and no ext
types (no pickle anywhere), and every field is type- and range-checked, so a
malformed frame becomes one `ProtocolError` with a contract error code.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

import msgpack
import numpy as np

from ipc import chat, jsonvalue
from meshnode.core import reasons as R
from meshnode.core.types import FORMATS, POOLINGS, SAMPLING_OPTIONS, ResponseFormat, Sampling

VERSION = b"MN1"
TELEMETRY_TOPIC = b"telemetry"
MAX_MESSAGE_BYTES = 1 << 20  # the largest payload served; the socket takes up to 2x (TOO_LARGE), then drops
MAX_ID_CHARS = 128
MAX_LIST = 1 << 16  # tokens in one prompt, entries in one list
MAX_TEXT_BYTES = 256 * 1024
MAX_NEW_TOKENS = 1 << 20
MAX_STOP_TOKENS = 64
MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 256
MAX_LOGPROBS = 20
PRIORITY_RANGE = 1 << 31  # priorities are compared, never counted: any 32-bit value a router sends
MAX_FORMAT_BYTES = 64 * 1024  # a response_format's schema, regex or grammar
KV_CHUNK_BYTES = 512 * 1024  # a moving session's KV travels in `kv` messages of at most this many bytes
_UNPACK = dict(max_str_len=MAX_TEXT_BYTES, max_bin_len=KV_CHUNK_BYTES,
               max_array_len=MAX_LIST, max_map_len=64, max_ext_len=0, strict_map_key=True, raw=False,
               use_list=True)


class ProtocolError(Exception):
    def __init__(self, code: str, detail: str, id: str | None = None):
        super().__init__(detail)
        self.code, self.detail, self.id = code, detail, id


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES, **limits):
    """msgpack with the link's limits; an ext type or an oversize item raises ValueError."""
    if len(data) > max_bytes:
        raise ValueError(f"message of {len(data)} bytes exceeds max_bytes {max_bytes}")
    return msgpack.unpackb(data, **{**_UNPACK, **limits})


# -- client requests ------------------------------------------------------------------
@dataclass
class Submit:
    id: str
    max_tokens: int | None  # None: as many as the session's context share leaves after the prompt
    tokens: list[int] | None = None
    text: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    stop_tokens: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    recipe: str | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the decoded text
    # [{role, content}] (+ tool_calls, tool_call_id, name: ipc/chat.py), formatted with the model's chat template
    messages: list[dict] | None = None
    response_format: ResponseFormat | None = None  # constrained output (json schema, regex, grammar)
    special: bool = False  # `text` spells special tokens (<|im_start|>): parse them, as llama-server's completions
    tools: list[dict] | None = None  # functions the template lists ({name, description, parameters}: ipc/chat.py)
    priority: int = 0  # vLLM's meaning: lower is served earlier (a node with --scheduling-policy priority)
    # vLLM's chat options (messages only); None: llama-server's way (the assistant's turn opened; a final
    # assistant message continued)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    embed: str | bool | None = None  # an embedding, not a generation: how its rows pool (mean, cls, last; true:
    # the node's `pooling`)
    generated: list[int] | None = None  # an `import`: the tokens the session generated elsewhere (`exported`)
    kv: KvHeader | None = None  # an `import` whose KV follows in `kv` messages
    progress: bool = False  # `progress` events as its prompt is computed (llama-server's return_progress)
    echo: bool = False  # its `admitted` carries the prompt's token ids, as the node tokenized or rendered it


@dataclass(frozen=True)
class KvHeader:
    """A moving session's KV: llama.cpp's per-sequence state of its first `positions` tokens, `bytes` long,
    whose SHA-256 is `sha256` (hex)."""
    bytes: int
    sha256: str
    positions: int
    mac: str = ""  # HMAC-SHA256 by the exporting node's mesh key (ipc/moving.py `sign`), hex; "" unsigned


@dataclass
class Export:
    id: str


@dataclass
class KvChunk:
    """Part of an import's KV, at `offset` in it (the parts come in order)."""
    id: str
    offset: int
    data: bytes


@dataclass
class Count:
    """How many tokens a submit's prompt is, as the node would tokenize or render it, with nothing generated
    (Anthropic's count_tokens): answered `counted`."""
    submit: Submit

    @property
    def id(self) -> str:
        return self.submit.id


@dataclass
class Cancel:
    id: str


@dataclass
class Status:
    prompt_tokens: int | None = None  # estimate the first-token delay of a prompt this long


@dataclass
class Ping:
    pass


@dataclass
class Metrics:
    """The node's Prometheus text, as its /metrics serves it (the HTTP gateway's /metrics asks for it)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _check(ok: bool, detail: str, id=None) -> None:
    if not ok:
        raise ProtocolError(R.BAD_REQUEST, detail, id)


def _token_list(v, name: str, n_vocab: int, id, limit: int = MAX_LIST) -> list[int]:
    """Checked in C-speed passes, not a Python loop per token: this runs in the tick loop."""
    _check(isinstance(v, list), f"{name} must be a list of int", id)
    _check(len(v) <= limit, f"{name} has {len(v)} entries, at most {limit} allowed", id)
    _check(set(map(type, v)) <= {int}, f"{name} must hold only ints", id)  # bool is not int here
    if v:
        try:
            arr = np.fromiter(v, np.int64, len(v))
        except OverflowError:
            arr = None
        bad = None if arr is not None and 0 <= arr.min() and arr.max() < n_vocab else \
            next(t for t in v if not 0 <= t < n_vocab)
        _check(bad is None, f"{name} holds token id {bad}, outside [0, {n_vocab})", id)
    return v


def _sampling(v, id, logprobs: int) -> Sampling:
    _check(isinstance(v, dict), "sampling must be a map", id)
    d = Sampling()
    o = {name: v.get(name, getattr(d, name)) for name in SAMPLING_OPTIONS}
    _check(_is_num(o["temperature"]) and 0 <= o["temperature"] <= 100,
           "sampling.temperature must be a number in [0, 100]", id)
    _check(_is_int(o["top_k"]) and 0 <= o["top_k"] <= MAX_LIST, "sampling.top_k must be an int >= 0", id)
    _check(_is_num(o["top_p"]) and 0 < o["top_p"] <= 1, "sampling.top_p must be a number in (0, 1]", id)
    _check(_is_int(o["seed"]) and -(1 << 63) <= o["seed"] < (1 << 64), "sampling.seed must be a 64-bit int", id)
    _check(_is_num(o["min_p"]) and 0 <= o["min_p"] <= 1, "sampling.min_p must be a number in [0, 1]", id)
    _check(_is_num(o["repeat_penalty"]) and 0 < o["repeat_penalty"] <= 10,
           "sampling.repeat_penalty must be a number in (0, 10] (1 = off)", id)
    _check(_is_int(o["repeat_last_n"]) and 0 <= o["repeat_last_n"] <= MAX_LIST,
           f"sampling.repeat_last_n must be an int in [0, {MAX_LIST}]", id)
    for name in ("presence_penalty", "frequency_penalty"):
        _check(_is_num(o[name]) and -2 <= o[name] <= 2, f"sampling.{name} must be a number in [-2, 2]", id)
    return Sampling(**{name: type(getattr(d, name))(o[name]) for name in SAMPLING_OPTIONS}, logprobs=logprobs)


def _response_format(v, id) -> ResponseFormat | None:
    """{"type": "json_schema", "schema": {...}} | {"type": "json_object"} | {"type": "regex", "pattern": ".."}
    | {"type": "grammar", "gbnf": ".."} | {"type": "lark", "lark": ".."}: shape and size only; the constraint
    library judges the content."""
    if v is None:
        return None
    _check(isinstance(v, dict) and v.get("type") in FORMATS,
           f"response_format must be a map with type one of {', '.join(FORMATS)}", id)
    kind = v["type"]
    if kind == "json_object":
        return ResponseFormat(kind)
    key = {"json_schema": "schema", "regex": "pattern", "grammar": "gbnf", "lark": "lark"}[kind]
    spec = v.get(key)
    if kind == "json_schema":
        _check(isinstance(spec, (dict, bool)), "response_format.schema must be a JSON schema (a map)", id)
        try:
            jsonvalue.check(spec, "response_format.schema")
        except ValueError as e:
            raise ProtocolError(R.BAD_REQUEST, str(e), id) from None
        spec = json.dumps(spec, separators=(",", ":"))
    _check(isinstance(spec, str) and spec, f"response_format.{key} must be a non-empty string", id)
    _check(len(spec.encode()) <= MAX_FORMAT_BYTES, f"response_format.{key} over {MAX_FORMAT_BYTES} bytes", id)
    return ResponseFormat(kind, spec)


def _stop_strings(v, id) -> list[str]:
    _check(isinstance(v, list) and len(v) <= MAX_STOP_STRINGS
           and all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_CHARS for s in v),
           f"stop must be a list of at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters", id)
    return list(v)


def _chat(parse, v, id) -> list[dict]:
    try:
        return parse(v, MAX_TEXT_BYTES)
    except ValueError as e:
        raise ProtocolError(R.BAD_REQUEST, str(e), id) from None


def request_id(frames: list[bytes]) -> str | None:
    """The request's id when it can be read, for answering a request the node will not decode (over a limit,
    or behind too many others): the client then learns which one failed. Only the map's keys and the id
    itself are unpacked; every other value is skipped unread, so no limit of the full decode applies (the
    frame itself is bounded by the socket's MAXMSGSIZE)."""
    if len(frames) != 2 or frames[0] != VERSION:
        return None
    data = frames[1]
    n = len(data)
    try:
        u = msgpack.Unpacker(raw=False, max_buffer_size=max(n, 1), max_str_len=n, max_bin_len=n, max_array_len=n,
                             max_map_len=n, max_ext_len=0, strict_map_key=False)
        u.feed(data)
        for _ in range(min(u.read_map_header(), 64)):
            key = u.unpack()
            if key != "id":
                u.skip()
                continue
            raw = u.unpack()
            return raw if isinstance(raw, str) and 1 <= len(raw) <= MAX_ID_CHARS else None
    except Exception:  # not a map, truncated, too deep: no id to be had
        return None
    return None


def decode_request(frames: list[bytes], n_vocab: int):
    """Frames after the ROUTER identity -> Submit / Cancel / Status / Ping, or ProtocolError."""
    if len(frames) != 2:
        raise ProtocolError(R.BAD_REQUEST, f"expected 2 frames [version, payload], got {len(frames)}")
    if frames[0] != VERSION:
        raise ProtocolError(R.UNSUPPORTED_VERSION, f"version frame must be {VERSION!r}")
    if len(frames[1]) > MAX_MESSAGE_BYTES:
        raise ProtocolError(R.TOO_LARGE, f"payload over {MAX_MESSAGE_BYTES} bytes", request_id(frames))
    try:
        msg = unpack(frames[1])
    except ValueError as e:  # msgpack's limit errors are ValueErrors
        code = R.TOO_LARGE if "exceeds max" in str(e) else R.BAD_REQUEST
        raise ProtocolError(code, f"payload is not valid msgpack within limits: {e}", request_id(frames)) from None
    except Exception as e:
        raise ProtocolError(R.BAD_REQUEST, f"payload is not valid msgpack: {type(e).__name__}",
                            request_id(frames)) from None
    if not isinstance(msg, dict):
        raise ProtocolError(R.BAD_REQUEST, "payload must be a msgpack map")
    op = msg.get("op")
    raw_id = msg.get("id")
    id = raw_id if isinstance(raw_id, str) and 1 <= len(raw_id) <= MAX_ID_CHARS else None
    if op == "ping":
        return Ping()
    if op == "metrics":
        return Metrics()
    if op == "status":
        pt = msg.get("prompt_tokens")
        _check(pt is None or (_is_int(pt) and 1 <= pt <= MAX_NEW_TOKENS),
               f"prompt_tokens must be an int in [1, {MAX_NEW_TOKENS}]", id)
        return Status(pt)
    if op not in ("submit", "cancel", "export", "import", "kv", "count"):
        raise ProtocolError(R.BAD_REQUEST, f"unknown op {op!r}; expected submit, cancel, export, import, kv, "
                            "count, status, metrics or ping", id)
    _check(id is not None, f"id must be a string of 1 to {MAX_ID_CHARS} characters")
    if op == "cancel":
        return Cancel(id)
    if op == "export":
        return Export(id)
    if op == "kv":
        offset, data = msg.get("offset"), msg.get("data")
        _check(_is_int(offset) and offset >= 0 and isinstance(data, bytes) and data,
               "kv needs offset (an int >= 0) and data (bytes, not empty)", id)
        return KvChunk(id, offset, data)
    if op == "import":
        return _import(msg, id, n_vocab)
    if op == "count":
        _check(msg.get("embed") is None, "count takes a generation's prompt (no embed)", id)
        return Count(_submit(msg, id, n_vocab))
    return _submit(msg, id, n_vocab)


def _import(msg: dict, id: str, n_vocab: int) -> Submit:
    """A session another node exported: its `exported` state as a submit of its prompt's tokens, plus what it
    generated there, on the same recipe."""
    _check(msg.get("tokens") is not None and msg.get("text") is None and msg.get("messages") is None,
           "import needs the exported prompt's tokens (not text or messages)", id)
    _check(isinstance(msg.get("recipe"), str), "import needs the exported session's recipe", id)
    _check(msg.get("response_format") is None and msg.get("embed") is None,
           "an import carries no response_format or embed (such sessions are not exported)", id)
    generated = _token_list(msg.get("generated"), "generated", n_vocab, id, MAX_NEW_TOKENS)
    mt = msg.get("max_tokens")
    _check(_is_int(mt) and mt > len(generated), "import needs max_tokens above the tokens generated so far", id)
    sub = _submit(msg, id, n_vocab)
    return replace(sub, generated=generated, kv=_kv_header(msg.get("kv"), len(sub.tokens) + len(generated), id))


def _kv_header(v, n_tokens: int, id: str) -> KvHeader | None:
    if v is None:
        return None
    fields = {"bytes", "sha256", "positions"}
    _check(isinstance(v, dict) and fields <= set(v) <= fields | {"mac"},
           "kv must be a map of bytes, sha256, positions and, where signed, mac (the exported state's, unchanged)", id)
    mac = v.get("mac", "")
    _check(isinstance(mac, str) and len(mac) in (0, 64) and all(c in "0123456789abcdef" for c in mac),
           "kv.mac must be 64 lowercase hex digits", id)
    n, digest, positions = v["bytes"], v["sha256"], v["positions"]
    _check(_is_int(n) and n > 0, "kv.bytes must be an int above 0", id)
    _check(isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
           "kv.sha256 must be 64 lowercase hex digits", id)
    _check(_is_int(positions) and 1 <= positions <= n_tokens,
           f"kv.positions must be an int in [1, {n_tokens}] (the state's tokens)", id)
    return KvHeader(n, digest, positions, mac)



def _submit(msg: dict, id: str, n_vocab: int) -> Submit:
    """A submit's fields, each checked (ProtocolError naming the first wrong one)."""
    mt = msg.get("max_tokens")
    _check(mt is None or (_is_int(mt) and 1 <= mt <= MAX_NEW_TOKENS),
           f"max_tokens must be an int in [1, {MAX_NEW_TOKENS}] (or absent: up to the context)", id)
    has_tokens, has_text, has_msgs = (msg.get(k) is not None for k in ("tokens", "text", "messages"))
    _check(has_tokens + has_text + has_msgs == 1, "exactly one of tokens, text or messages is required", id)
    tokens = _token_list(msg["tokens"], "tokens", n_vocab, id) if has_tokens else None
    text = msg.get("text")
    _check(text is None or isinstance(text, str), "text must be a string", id)
    lps = msg.get("logprobs", 0)
    _check(_is_int(lps) and 0 <= lps <= MAX_LOGPROBS, f"logprobs must be an int in [0, {MAX_LOGPROBS}]", id)
    sampling = _sampling(msg.get("sampling") or {}, id, lps)
    stop = msg.get("stop_tokens") or []
    stop = _token_list(stop, "stop_tokens", n_vocab, id, MAX_STOP_TOKENS)
    ignore_eos = msg.get("ignore_eos", False)
    _check(isinstance(ignore_eos, bool), "ignore_eos must be a bool", id)
    recipe = msg.get("recipe")
    _check(recipe is None or (isinstance(recipe, str) and len(recipe) <= 256), "recipe must be a string", id)
    stops = _stop_strings(msg.get("stop") or [], id)
    messages = _chat(chat.messages, msg["messages"], id) if has_msgs else None
    tools = _chat(chat.tools, msg["tools"], id) if msg.get("tools") is not None else None
    _check(tools is None or has_msgs, "tools go with messages", id)
    fmt = _response_format(msg.get("response_format"), id)
    _check(fmt is None or not ignore_eos, "ignore_eos cannot be combined with response_format: a constrained "
           "answer ends when it is complete", id)
    special = msg.get("special", False)
    _check(isinstance(special, bool) and (not special or has_text), "special must be a bool, and only with text", id)
    priority = msg.get("priority", 0)
    _check(_is_int(priority) and -PRIORITY_RANGE <= priority <= PRIORITY_RANGE,
           f"priority must be an int in [-{PRIORITY_RANGE}, {PRIORITY_RANGE}] (lower is served earlier)", id)
    turn = {k: msg.get(k) for k in ("add_generation_prompt", "continue_final_message")}
    for k, v in turn.items():
        _check(v is None or (isinstance(v, bool) and has_msgs), f"{k} must be a bool, and only with messages", id)
    _check(not (turn["add_generation_prompt"] and turn["continue_final_message"]),
           "add_generation_prompt and continue_final_message cannot both be true: a continued message opens no "
           "new turn", id)
    _check(not turn["continue_final_message"] or (has_msgs and messages and messages[-1]["role"] == "assistant"),
           "continue_final_message needs the last message to be the assistant's", id)
    embed = msg.get("embed")
    _check(embed is None or ((embed is True or embed in POOLINGS) and (has_tokens or has_text) and mt is None
                             and fmt is None),
           f"embed must be true (the node's pooling) or one of {', '.join(POOLINGS)}, with tokens or text, and "
           "without max_tokens or response_format", id)
    flags = {k: msg.get(k, False) for k in ("progress", "echo")}
    for k, v in flags.items():
        _check(isinstance(v, bool), f"{k} must be a bool", id)
    return Submit(id, mt, tokens, text, sampling, stop, ignore_eos, recipe, stops, messages, fmt, special, tools,
                  priority, turn["add_generation_prompt"], turn["continue_final_message"], embed, **flags)

def encode_request(req) -> list[bytes]:
    """Client side: a request dataclass -> the two frames."""
    count = isinstance(req, Count)
    req = req.submit if count else req
    op = {Submit: "submit", Cancel: "cancel", Status: "status", Ping: "ping", Metrics: "metrics",
          Export: "export", KvChunk: "kv"}[type(req)]
    if isinstance(req, Submit) and req.generated is not None:
        op = "import"
    op = "count" if count else op
    body = {"op": op}
    for k, v in asdict(req).items():
        if v is None or (k in ("stop_tokens", "stop", "ignore_eos", "special", "priority", "progress", "echo")
                         and not v):
            continue
        body[k] = v
    if isinstance(req, Submit):
        body["sampling"] = {k: v for k, v in asdict(req.sampling).items() if k != "logprobs"}
        if req.response_format is not None:
            body["response_format"] = _format_wire(req.response_format)
        if req.sampling.logprobs:
            body["logprobs"] = req.sampling.logprobs
    return [VERSION, pack(body)]


def _format_wire(f: ResponseFormat) -> dict:
    if f.kind == "json_object":
        return {"type": f.kind}
    if f.kind == "json_schema":
        return {"type": f.kind, "schema": json.loads(f.spec)}
    return {"type": f.kind, {"regex": "pattern", "grammar": "gbnf", "lark": "lark"}[f.kind]: f.spec}
