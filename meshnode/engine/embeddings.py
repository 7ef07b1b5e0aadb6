"""Embeddings beside generation: an embedding session's prompt chunks run with llama.cpp's embeddings output on,
and their rows' final hidden states (after the last norm, before the output projection) are pooled here.

llama.cpp pools inside its graph only in a context made for embeddings (`pooling_type` at creation, one
batch a sequence); here the same context generates too, so it keeps pooling `none`, the engine turns
embeddings on for the calls that hold embedding chunks only (`llama_set_embeddings`), and the pooling is
done over the rows as they come, chunk by chunk, so a prompt longer than one call is pooled whole:
`mean` (every row), `cls` (the first row), `last` (the last). The vector is L2-normalized, as llama-server's
/v1/embeddings returns it. What it costs: every row of such a call is an output row, so llama.cpp also
computes its logits (the output projection), and the logits buffer grows to a whole batch of rows once.
"""
from __future__ import annotations

import numpy as np


class Pools:
    """Per sequence, what its embedding rows so far pool to: (sum of rows, rows, first row, last row)."""

    def __init__(self):
        self._acc: dict[int, list] = {}

    def add(self, seq: int, rows: np.ndarray, first: bool) -> None:
        """`rows` (n x n_embd, float32) of the sequence's next positions; `first`: they start at position 0."""
        rows = rows.astype(np.float64)
        acc = self._acc.get(seq)
        if acc is None or first:
            self._acc[seq] = [rows.sum(axis=0), len(rows), rows[0].copy(), rows[-1].copy()]
            return
        acc[0] += rows.sum(axis=0)
        acc[1] += len(rows)
        acc[3] = rows[-1].copy()

    def take(self, seq: int, how: str) -> list[float]:
        """The sequence's pooled, L2-normalized vector; its rows are forgotten."""
        total, n, first, last = self._acc.pop(seq)
        v = {"mean": total / n, "cls": first, "last": last}[how]
        norm = float(np.linalg.norm(v))
        return (v / norm if norm > 0 else v).astype(np.float32).tolist()

    def forget(self, seq: int) -> None:
        self._acc.pop(seq, None)
