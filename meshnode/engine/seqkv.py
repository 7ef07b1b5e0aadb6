"""A llama.cpp context's KV, by sequence: the one place its memory and per-sequence state calls are made.

The engine (engine/llama.py) and the draft model (engine/draftmodel.py) each hold
a context whose KV they cut, copy and query by sequence; a moving session's KV is
written to and read from llama.cpp's own per-sequence state files here too
(core/moves.py). llama.cpp's conventions, in one place: -1 for "to the end" or
"from the start", a position range [p0, p1), pos_max -1 for an empty sequence,
0 bytes for a state file it could not write or read.
"""
from __future__ import annotations

import ctypes


class SeqKV:
    def __init__(self, lc, ctx):
        self._lc, self._ctx, self._mem = lc, ctx, lc.llama_get_memory(ctx)

    def drop(self, seq: int, keep: int = 0) -> None:
        """The sequence keeps its first `keep` positions (0: none)."""
        self._lc.llama_memory_seq_rm(self._mem, seq, keep, -1)

    def copy(self, src: int, dst: int, n: int = -1) -> None:
        """`dst` gets `src`'s first `n` positions (-1: all of them); across streams llama.cpp copies the whole
        stream at the next decode."""
        self._lc.llama_memory_seq_cp(self._mem, src, dst, 0 if n >= 0 else -1, n)

    def positions(self, seq: int) -> int:
        """How many positions the sequence holds (its last one + 1)."""
        return int(self._lc.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def first(self, seq: int) -> int:
        """The sequence's lowest position (-1 when empty)."""
        return int(self._lc.llama_memory_seq_pos_min(self._mem, seq))

    def clear(self) -> None:
        self._lc.llama_memory_clear(self._mem, True)

    def state_bytes(self, seq: int) -> int:
        return int(self._lc.llama_state_seq_get_size(self._ctx, seq))

    def save(self, seq: int, path: str, tokens: list[int]) -> int:
        """The sequence's cells and `tokens` to `path` (llama_state_seq_save_file); the bytes written, 0 if none."""
        arr = (self._lc.llama_token * len(tokens))(*tokens)
        return int(self._lc.llama_state_seq_save_file(self._ctx, path.encode(), seq, arr, len(tokens)))

    def load(self, seq: int, path: str, capacity: int) -> list[int] | None:
        """A state file's cells into the empty sequence; the tokens saved with them, None if llama.cpp refused
        the file (its format, its size, no room: its checks)."""
        out, count = (self._lc.llama_token * capacity)(), ctypes.c_size_t(0)
        if not self._lc.llama_state_seq_load_file(self._ctx, path.encode(), seq, out, capacity, ctypes.byref(count)):
            return None
        return list(out[:count.value])
