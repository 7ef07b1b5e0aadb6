"""OpenAI's /v1/embeddings in the node's terms, with no I/O: each input one embedding session of the node (its
`submit` with `embed`, pooled as the node's `pooling` says: engine/embeddings.py), the vectors back in OpenAI's
list, as floats or base64 of little-endian float32."""
from __future__ import annotations

import base64

import numpy as np

from ipc import protocol as P
from meshnode.gateway.api import ApiError

MAX_INPUTS = 256  # inputs one /v1/embeddings request may hold (each an embedding session of the node)


def parse(body, new_id) -> tuple[list[P.Submit], str]:
    """A /v1/embeddings body -> one embedding submit an input (the node's pooling), and the encoding
    ("float" or "base64")."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("dimensions") is not None:
        raise ApiError(400, "dimensions is not supported: the model's embeddings have its width", param="dimensions")
    enc = body.get("encoding_format") or "float"
    if enc not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be float or base64", param="encoding_format")
    x = body.get("input")
    if isinstance(x, str) or (isinstance(x, list) and x and all(type(t) is int for t in x)):
        x = [x]
    if isinstance(x, list):  # llama-server's input objects in a list: {"content": text, or text parts}
        x = [_content(i) if isinstance(i, dict) else i for i in x]
    if not (isinstance(x, list) and 0 < len(x) <= MAX_INPUTS and all(
            isinstance(i, str) or (isinstance(i, list) and i and all(type(t) is int for t in i)) for i in x)):
        raise ApiError(400, f"input must be a string, a list of token ids, or a list of 1 to {MAX_INPUTS} of either",
                       param="input")
    return [P.Submit(new_id(), None, None if isinstance(i, str) else i, i if isinstance(i, str) else None,
                     embed=True) for i in x], enc


def _content(item: dict) -> str:
    c = item.get("content")
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    if not isinstance(c, str):
        raise ApiError(400, "an input object's content must be a string or a list of text parts", param="input")
    return c


def answer(vectors: list[list[float]], prompt_tokens: int, model: str, enc: str) -> dict:
    """OpenAI's embeddings list, in the inputs' order."""
    def out(v):
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if enc == "base64" else v
    return {"object": "list", "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            "data": [{"object": "embedding", "index": i, "embedding": out(v)} for i, v in enumerate(vectors)]}
