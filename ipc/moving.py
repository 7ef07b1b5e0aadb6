"""A moving session's wire, client side (docs/protocol.md, "Moving a session"): the state an `exported` event
carries, the `import` request that sends it on to another node, and the KV's bytes as `kv` requests. The node
validates them with every other request (ipc/protocol.py)."""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import asdict, replace

import numpy as np

from ipc.protocol import KV_CHUNK_BYTES, VERSION, KvHeader, pack
from meshnode.core.types import Sampling


def export_state(prompt: list[int], generated: list[int], max_tokens: int, sampling: Sampling, stop_tokens: list[int],
                 ignore_eos: bool, stop: list[str], priority: int, recipe: str, kv: KvHeader | None = None) -> dict:
    """A session's state for another node on the same recipe: an `import` request but for its `op` and `id`
    (import_request); with `kv`, its KV's bytes go with it (as `kv` events, or `kv` requests)."""
    return {"tokens": prompt, "generated": generated, "max_tokens": max_tokens, "recipe": recipe,
            "sampling": {k: v for k, v in asdict(sampling).items() if k != "logprobs"},
            "logprobs": sampling.logprobs, "stop_tokens": stop_tokens, "ignore_eos": ignore_eos, "stop": stop,
            "priority": priority, **({"kv": asdict(kv)} if kv else {})}


def import_request(id: str, state: dict) -> list[bytes]:
    """Client side: an `exported` state sent on to another node as the session `id` there (its KV's bytes,
    when it has them, follow in kv_requests)."""
    body = {**state, "op": "import", "id": id}
    if isinstance(body.get("kv"), dict):
        body["kv"] = {k: body["kv"][k] for k in ("bytes", "sha256", "positions", "mac") if k in body["kv"]}
    return [VERSION, pack(body)]


def kv_requests(id: str, data: bytes) -> list[list[bytes]]:
    """Client side: an import's KV bytes as `kv` requests, in order."""
    return [[VERSION, pack({"op": "kv", "id": id, "offset": o, "data": data[o:o + KV_CHUNK_BYTES]})]
            for o in range(0, len(data), KV_CHUNK_BYTES)]


def _message(recipe: str, kv: KvHeader, tokens: list[int]) -> bytes:
    return b"\0".join([b"meshnode-kv-1", recipe.encode(), kv.sha256.encode(), str(kv.positions).encode(),
                       np.asarray(tokens[:kv.positions], "<i4").tobytes()])


def sign(key: bytes, recipe: str, kv: KvHeader, tokens: list[int]) -> KvHeader:
    """The KV's description signed with the mesh key: its bytes (by their SHA-256), the recipe and the tokens
    it was computed for, so a signature holds for that KV of that session only."""
    return replace(kv, mac=hmac.new(key, _message(recipe, kv, tokens), hashlib.sha256).hexdigest())


def signed(key: bytes, recipe: str, kv: KvHeader, tokens: list[int]) -> bool:
    """Whether a node holding `key` signed this KV for these tokens on this recipe."""
    want = hmac.new(key, _message(recipe, kv, tokens), hashlib.sha256).hexdigest()
    return bool(kv.mac) and hmac.compare_digest(want, kv.mac)
