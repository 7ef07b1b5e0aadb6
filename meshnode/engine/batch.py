"""The one llama_batch of a context and the logits its llama_decode leaves: the engine's and the draft model's.

The batch's arrays are numpy buffers we own, filled with slices (no per-row ctypes calls), one sequence a row.
After a decode the outputs are read as ONE array, a row per output: llama.h stores the logits of the rows that
asked for them contiguously in batch order, so one llama_get_logits call serves a tick, not one
llama_get_logits_ith a row (about 15 us each: 1 ms a tick at 64 rows).
"""
from __future__ import annotations

import ctypes

import numpy as np

from meshnode.core.types import FatalEngineError


class Batch:
    def __init__(self, lc, ctx, capacity: int, n_vocab: int):
        self._lc, self._ctx, self.n_vocab = lc, ctx, n_vocab
        self.tok = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.want = np.zeros(capacity, np.int8)  # 1: the row's logits are read after the decode
        self._nseq = np.ones(capacity, np.int32)
        self._seq_ptrs = (self.seq.ctypes.data + 4 * np.arange(capacity, dtype=np.uint64)).astype(np.uint64)
        b = lc.llama_batch()
        b.token = self.tok.ctypes.data_as(ctypes.POINTER(lc.llama_token))
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(lc.llama_pos))
        b.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._seq_ptrs.ctypes.data, ctypes.POINTER(ctypes.POINTER(lc.llama_seq_id)))
        b.logits = self.want.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._raw = b
        self.n = 0  # rows in use
        self._out_of_row = np.zeros(0, np.int64)
        self._logits = None

    def put(self, i: int, tokens, pos: int, seq: int) -> int:
        """Rows i.. for `tokens` of sequence `seq` from position `pos`, none asking for logits; the next row."""
        n = len(tokens)
        self.tok[i:i + n] = tokens
        self.pos[i:i + n] = np.arange(pos, pos + n, dtype=np.int32)
        self.seq[i:i + n] = seq
        self.want[i:i + n] = 0
        return i + n

    def decode(self) -> int:
        """llama_decode of the first `n` rows; its return code (0: the outputs are readable)."""
        self._raw.n_tokens = self.n
        rc = self._lc.llama_decode(self._ctx, self._raw)
        if rc == 0:
            want = self.want[:self.n]
            self._out_of_row = np.cumsum(want, dtype=np.int64) - 1
            outs = int(self._out_of_row[-1]) + 1 if self.n else 0
            ptr = self._lc.llama_get_logits(self._ctx)
            if outs and not ptr:
                raise FatalEngineError("llama.cpp returned no logits")
            self._logits = np.ctypeslib.as_array(ptr, shape=(outs, self.n_vocab)) if outs else None
        return rc

    def logits(self, row: int) -> np.ndarray:
        """The last decode's logits of batch row `row` (a view: read it before the next decode)."""
        if not self.want[row]:
            raise FatalEngineError(f"batch row {row} did not ask for logits")
        return self._logits[self._out_of_row[row]]
