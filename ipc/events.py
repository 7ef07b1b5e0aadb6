"""Every event the node sends a client (docs/protocol.md), and the client's decoding of them.

Two frames `[b"MN1", msgpack map]` with an `event` key; the telemetry and KV-event publications are PUB
topics. The requests a client sends, with their validation, are ipc/protocol.py's.
"""
from __future__ import annotations

from ipc.protocol import KV_CHUNK_BYTES, MAX_MESSAGE_BYTES, TELEMETRY_TOPIC, VERSION, ProtocolError, pack, unpack
from meshnode.core import reasons as R


def event(kind: str, **fields) -> list[bytes]:
    return [VERSION, pack({"event": kind, **fields})]


def pong() -> list[bytes]:
    return event("pong")


def embedding(id: str, vector: list[float], prompt_tokens: int) -> list[bytes]:
    return event("embedding", id=id, embedding=vector, prompt_tokens=prompt_tokens)


def metrics(text: str) -> list[bytes]:
    return event("metrics", text=text)


def status(node: dict, telemetry: dict, capacity: dict) -> list[bytes]:
    return event("status", node=node, telemetry=telemetry, capacity=capacity)


KV_TOPIC = b"kv-events"


def kv_events(seq: int, ts: float, events: list[list]) -> list[bytes]:
    """A batch of prefix-cache events as vLLM publishes them (docs/operating.md, "Routers"): topic, sequence
    number (8 bytes big-endian, +1 a batch: a gap is a lost batch), msgpack [ts, [events], data_parallel_rank]
    (vLLM's KVEventBatch; Dynamo refuses a batch without the rank). One engine a node: rank 0."""
    return [KV_TOPIC, seq.to_bytes(8, "big"), pack([ts, events, 0])]


def tokens(id: str, toks: list[int], text: str, logprobs: list | None = None) -> list[bytes]:
    if logprobs is None:
        return event("tokens", id=id, tokens=toks, text=text)
    lps = [{"token": t, "logprob": lp.logprob, "top": [{"token": a, "logprob": b} for a, b in lp.top]}
           for t, lp in zip(toks, logprobs)]
    return event("tokens", id=id, tokens=toks, text=text, logprobs=lps)


def done(id: str, reason: str, toks: list[int], text: str, usage: dict, detail: str = "",
         incomplete: bool = False, stop: str = "") -> list[bytes]:
    """`incomplete`: a constrained (response_format) session ended before its output matched in full; `stop`:
    the stop string that ended it (vLLM's `stop_reason`, Anthropic's `stop_sequence`)."""
    return event("done", id=id, reason=reason, tokens=toks, text=text, usage=usage, **({"detail": detail} if detail else {}),
                 **({"incomplete": True} if incomplete else {}), **({"stop": stop} if stop else {}))


def telemetry(snapshot: dict) -> list[bytes]:
    """A PUB publication: the topic frame, then one full snapshot."""
    return [TELEMETRY_TOPIC, pack(snapshot)]


def admitted(id: str, reason: str, prompt: list[int] | None = None) -> list[bytes]:
    """`prompt`: the session's prompt ids, for a submit that asked `echo`."""
    return event("admitted", id=id, state=R.RUNNING if reason == R.ADMITTED else R.QUEUED, reason=reason,
                 **({"prompt": [int(t) for t in prompt]} if prompt is not None else {}))


def counted(id: str, prompt_tokens: int) -> list[bytes]:
    return event("counted", id=id, prompt_tokens=prompt_tokens)


def progress(id: str, total: int, cache: int, processed: int, time_ms: float) -> list[bytes]:
    """How far a session's prompt is computed (a submit that asked `progress`): llama-server's prompt_progress."""
    return event("progress", id=id, total=total, cache=cache, processed=processed, time_ms=round(time_ms, 3))


def exported(id: str, state: dict) -> list[bytes]:
    return event("exported", id=id, state=state)


def kv_parts(id: str, data: bytes) -> list[list[bytes]]:
    """An export's KV bytes as `kv` events, in order (the `exported` event's `kv` describes them)."""
    return [event("kv", id=id, offset=o, data=data[o:o + KV_CHUNK_BYTES]) for o in range(0, len(data), KV_CHUNK_BYTES)]


def rejected(id: str, reason: str, detail: str, facts: dict | None = None) -> list[bytes]:
    """`facts`: the numbers behind a refusal, where the reason has them (REJECTED_CONTEXT_TOO_LONG: n_prompt_tokens,
    n_ctx)."""
    return event("rejected", id=id, reason=reason, detail=detail, **(facts or {}))


def error(code: str, detail: str, id: str | None = None) -> list[bytes]:
    return event("error", code=code, detail=detail, **({"id": id} if id is not None else {}))


def decode_event(frames: list[bytes]) -> dict:
    """Client side: two frames -> the event map (trusted peer, but still bounded)."""
    if len(frames) != 2 or frames[0] != VERSION:
        raise ProtocolError(R.UNSUPPORTED_VERSION, "not an MN1 event")
    msg = unpack(frames[1], max_bytes=64 * MAX_MESSAGE_BYTES)
    if not isinstance(msg, dict) or "event" not in msg:
        raise ProtocolError(R.BAD_REQUEST, "event is not a map with an 'event' key")
    return msg
