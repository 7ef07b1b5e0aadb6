"""The head of llama.cpp's per-sequence state file (llama_state_seq_save_file), which a moving session's KV is.

The file is `magic, version, n_tokens` (u32 each, little-endian), the tokens
(i32 each), then the KV cells. The front reads only the head: before an
arriving session is admitted, the tokens its KV was computed for must be the
ones its state says, or its next tokens would continue another text. The cells
themselves are llama.cpp's to check when it loads them.
"""
from __future__ import annotations

import struct

import numpy as np

MAGIC = 0x67677371  # 'ggsq', LLAMA_STATE_SEQ_MAGIC
VERSION = 3  # LLAMA_STATE_SEQ_VERSION of the vendored llama.cpp
_HEAD = struct.Struct("<III")


def head(tokens: list[int]) -> bytes:
    """The head a file of these tokens starts with (an engine that writes its own cells after it: the fake)."""
    return _HEAD.pack(MAGIC, VERSION, len(tokens)) + np.asarray(tokens, "<i4").tobytes()


def tokens_in(path: str) -> list[int]:
    """The tokens a state file holds the KV of; ValueError when it is not such a file."""
    with open(path, "rb") as f:
        raw = f.read(_HEAD.size)
        if len(raw) < _HEAD.size:
            raise ValueError("it is shorter than a llama.cpp sequence state's head")
        magic, version, n = _HEAD.unpack(raw)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"it is not a llama.cpp sequence state of version {VERSION} (magic {magic:#x}, "
                             f"version {version})")
        data = f.read(4 * n)
    if len(data) < 4 * n:
        raise ValueError(f"it says {n} tokens but holds fewer")
    return np.frombuffer(data, "<i4").tolist()


def holds(path: str, tokens: list[int]) -> bool:
    """Whether the state file's KV was computed for `tokens` (its own tokens start with them); ValueError when it
    is not such a file."""
    return tokens_in(path)[:len(tokens)] == list(tokens)
