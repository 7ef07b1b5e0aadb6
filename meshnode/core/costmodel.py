"""How long a tick will take, learned from the ticks that ran: prefill is sized by it.

A tick's engine time is close to linear in three things: a fixed part (the weights
are streamed once per pass, whatever the rows), a part per row (token) in the batch,
and attention, which grows with each row times the KV cells it attends to (on a
unified KV every cell in use, on streams its own sequence's). The coefficients
depend on the model, the build and the machine, so they are fitted online, by least
squares over the last WINDOW ticks, with the worst-fitting tenth left out and fitted
again so that one stall (a page fault storm, a neighbour process) does not teach the
model that every tick is slow. Pure: the scheduler feeds it measured step times.
"""
from __future__ import annotations

from collections import deque

import numpy as np

COLD_PREFILL = 64  # prompt tokens per tick beside decoders until the model has learned the engine
MIN_PREFILL = 8  # however tight the target, prompts advance
WINDOW = 256  # ticks the fit covers: a few seconds of decoding, so it follows the KV as it grows
MIN_SAMPLES = 10  # below this the model does not guess
REFIT_EVERY = 8  # ticks between fits (a fit is ~100 us)


def attention(chunks, unified_cells: int) -> float:
    """The attention work of a tick, in row x cell units: `chunks` as (pos, n_tokens); on a unified
    KV every row attends to every cell in use (`unified_cells`), else to its own sequence's."""
    if unified_cells:
        return sum(n for _, n in chunks) * float(unified_cells)
    return float(sum(n * (pos + n) for pos, n in chunks))


class TickCost:
    """ms = base + per_row * rows + per_cell * attention, refitted as ticks report."""

    def __init__(self, window: int = WINDOW):
        self._x: deque = deque(maxlen=window)
        self._y: deque = deque(maxlen=window)
        self.coef: np.ndarray | None = None  # base ms, ms per row, ms per row x cell
        self._since_fit = 0
        self.outliers = 0  # ticks that took more than twice the prediction, once the model is ready

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def observe(self, rows: int, attn: float, ms: float) -> None:
        if rows <= 0 or ms <= 0:
            return
        if self.ready and ms > 2 * self.predict(rows, attn) + 5:
            self.outliers += 1
        self._x.append((1.0, float(rows), attn))
        self._y.append(ms)
        self._since_fit += 1
        if len(self._y) >= MIN_SAMPLES and (self._since_fit >= REFIT_EVERY or not self.ready):
            self._fit()

    def describe(self) -> dict:
        """The fitted costs, for telemetry: what a tick costs here, and how often one ran far over."""
        c = self.coef if self.ready else (None, None, None)
        return {"base_ms": c[0] and round(float(c[0]), 3), "ms_per_row": c[1] and round(float(c[1]), 4),
                "ms_per_row_cell": c[2] and float(c[2]), "samples": len(self._y), "outliers_total": self.outliers}

    def predict(self, rows: int, attn: float) -> float:
        b, r, a = self.coef
        return b + r * rows + a * attn

    def _fit(self) -> None:
        self._since_fit = 0
        x, y = np.array(self._x), np.array(self._y)
        coef, keep = _nonneg_lstsq(x, y), np.ones(len(y), bool)
        for _ in range(3):  # leave out what fits worst (relative to its size), fit again
            err = np.abs(x @ coef - y) / np.maximum(x @ coef, 1e-3)
            keep = err <= max(np.quantile(err, 0.9), 0.05)
            if keep.sum() < MIN_SAMPLES:
                break
            coef = _nonneg_lstsq(x[keep], y[keep])
        if coef[1] <= 0:  # every tick had the same rows: no slope to learn yet
            return
        self.coef = coef

    def rows_within(self, target_ms: float, rows: int, attn: float, per_row_cells: float) -> int:
        """How many more rows a tick of `rows` rows and `attn` attention can take and stay within
        `target_ms`, when each added row attends to about `per_row_cells` cells."""
        b, r, a = self.coef
        spare = target_ms - self.predict(rows, attn)
        marginal = r + a * per_row_cells
        return max(0, int(spare / marginal)) if marginal > 0 else 1 << 30


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a negative cost is noise, not physics): a feature
    whose coefficient comes out negative is dropped and the rest refitted."""
    cols = list(range(x.shape[1]))
    while True:
        c, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (c >= 0).all() or len(cols) == 1:
            out = np.zeros(x.shape[1])
            out[cols] = np.maximum(c, 0)
            return out
        cols.pop(int(np.argmin(c)))


def prefill_room(cost: TickCost, target_ms: float, top: int, rows: int, attn: float, unified_cells: int,
                 pos: int) -> int:
    """Prompt tokens for a tick with `rows` decode rows (their attention `attn`), the next prompt at
    position `pos`. With nobody decoding, the most the budget allows (a bigger batch is computed more
    efficiently and no one waits between tokens); with decoders and a target, what the model says fits
    it, but always some, so prompts move. Each prompt row attends to every cell in use on a unified KV,
    else to about its own position plus half a chunk."""
    if not rows or not target_ms:
        return top
    if not cost.ready:
        return min(top, COLD_PREFILL)
    per_row = unified_cells or pos + top / 2
    return min(top, max(MIN_PREFILL, cost.rows_within(target_ms, rows, attn, per_row)))
