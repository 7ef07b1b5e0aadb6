"""How long a tick will take, learned from the ticks that ran: prefill is sized by it.

A tick's engine time is close to linear in three things: a fixed part per llama_decode
call (the weights are streamed once per pass, whatever the rows; on streams the decode
rows and the prompt chunks of each length are separate calls), a part per row (token), and attention,
which grows with each row times the KV cells it attends to (on a unified KV every cell
in use, on streams its own sequence's). The coefficients depend on the model, the
build and the machine, so they are fitted online, by least squares, refitted every
few ticks; what the fit still gets wrong on the ticks it sizes (prompt rows beside decode
rows: measured 5-20 % under on a busy 2-core machine) is corrected by a high quantile of
their recent ratios of measured to predicted, so that the target bounds the ticks rather
than being their mean; for such ticks only: a lone prompt's big batches miss the other
way, and let into the same correction they made the next burst's first ticks run long.
The engine's start-up ticks include sized ones, so the first burst is corrected too
(without them the first burst's first ticks ran 1.15-1.27x the fit: README, "Prefill pacing").

What the fit sees decides what it can predict. Ticks are kept per shape (rows, by
powers of two), the last PER_SHAPE of each: a long stretch of decode-only ticks would
otherwise push every prefill tick out of a plain window, and the first burst after it
would be planned by a model that has forgotten what prompt rows and their attention
cost (measured: ticks planned at 450 ms ran 520-700 ms). Within a shape the newest
ticks win, so the model follows the KV as it grows. Ticks that fit far worse than the
rest (a page-fault storm, a neighbour process) are left out of the fit, so one stall
does not teach the model that every tick is slow. Pure: the scheduler feeds it
measured step times.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

PER_SHAPE = 32  # newest ticks kept per shape (rows 1, 2-3, 4-7, ... 512-1023, ...)
MIN_SAMPLES = 10  # below this the model does not guess
REFIT_MS = 50.0  # engine time a fit may lag behind: a fit costs 0.2-0.6 ms of the front's CPU, so at most
# about 1 % of the engine's time, and only while predictions are asked for (prompts beside decoders)
RATIOS = 16  # the last this many sized ticks (prompt rows beside decode rows) correct the model: ...
MISS_QUANTILE = 0.9  # ... sizing by this quantile of their misses (the target bounds ticks), estimates by the median
CORRECTION = (0.8, 1.5)  # how far that correction may go
DECODE_TICKS = 16  # the last this many decode-only ticks of a size are what a decode tick takes (their median)
PRIOR = 0.1  # how hard the fit holds the small-call excess at 0 (relative to its column)
TILE_ROWS = 64  # llama.cpp's CPU flash attention tiles a call of >= this many rows (GGML_FA_TILE_Q)


class Shape(NamedTuple):
    """What a tick's time depends on: llama_decode calls, rows, attention (row x cell), and the part
    of that attention in calls under TILE_ROWS rows. There it runs row by row, at several times the
    cost per cell (a 63-token chunk deep in a prompt takes about twice as long as a 64-token one:
    `python -m benchmarks ticks`, evidence/tick-shapes.json), so the excess is learned on its own; with
    no ticks that tell the two apart it stays 0 (the fit's prior)."""
    calls: int
    rows: int
    attn: float
    attn_small: float


def llama_calls(items: list, n_tokens, unified: bool) -> list[list]:
    """The llama_decode calls the engine makes for a tick's chunks (`n_tokens(item)` tokens each). Unified:
    one. Streams: llama.cpp splits a batch into ubatches of consecutive sequence ids with equal token counts
    (llama-batch.cpp, split_equal), each a pass over the weights, so every single-token row goes in one
    call, and the chunks of each length in one more (on consecutive streams: one ubatch), instead of a
    longer chunk being cut into a 1-token piece beside the decode rows. Four 32-token prompts on streams
    0-3 took 225 ms in one call against 294 ms in four (bench model, in process)."""
    if unified or len(items) < 2:
        return [list(items)] if items else []
    by_len: dict[int, list] = {}
    for c in items:
        by_len.setdefault(n_tokens(c), []).append(c)
    return ([by_len.pop(1)] if 1 in by_len else []) + list(by_len.values())


def shape(spans, unified_cells: int) -> Shape:
    """A tick of `spans` ((pos, n_tokens) per sequence), `unified_cells` the cells a unified pool holds
    after it (0 on streams), in the calls the engine makes. On streams each sequence's rows are attended
    on their own, so the tile rules apply per chunk; a unified pool is one stream of all the call's rows."""
    calls, rows, attn, small = 0, 0, 0.0, 0.0
    for g in llama_calls(spans, lambda s: s[1], bool(unified_cells)):
        calls, rows = calls + 1, rows + sum(k for _, k in g)
        for part in ([g] if unified_cells else [[c] for c in g]):
            n = sum(k for _, k in part)
            a = attention(part, unified_cells)
            if n >= TILE_ROWS:  # a partial last tile is computed whole
                a *= -(-n // TILE_ROWS) * TILE_ROWS / n
            attn, small = attn + a, small + (a if n < TILE_ROWS else 0.0)
    return Shape(max(1, calls), rows, attn, small)


def sized(spans) -> bool:
    """Prompt rows beside decode rows: a tick whose prefill the target sized."""
    return any(n == 1 for _, n in spans) and any(n > 1 for _, n in spans)


def attention(chunks, unified_cells: int) -> float:
    """The attention work of a tick, in row x cell units: `chunks` as (pos, n_tokens); on a unified
    KV every row attends to every cell in use (`unified_cells`), else to its own sequence's."""
    if unified_cells:
        return sum(n for _, n in chunks) * float(unified_cells)
    return float(sum(n * (pos + n) for pos, n in chunks))


class TickCost:
    """ms = per_call * calls + per_row * rows + per_cell * attention (+ the small-call excess), times
    the correction for sized ticks."""

    def __init__(self, per_shape: int = PER_SHAPE):
        self._per_shape = per_shape
        self._shapes: dict[int, deque] = {}  # rows.bit_length() -> (Shape, ms), newest last
        self._ratios: deque = deque(maxlen=RATIOS)  # measured / fitted, for the last sized ticks
        self._decode: dict[int, deque] = {}  # rows.bit_length() -> ms of the last decode-only ticks
        self._decode_ms: dict[int, float] = {}  # ... and their median, kept as they come (read every plan)
        self._cadence: dict[int, deque] = {}  # rows.bit_length() -> ms of the last decode-only ticks, all their steps
        self._cadence_ms: dict[int, float] = {}  # ... and their median
        self.correction = self.correction_bound = 1.0  # median and high quantile, once there are a few
        self._coef_now: np.ndarray | None = None  # ms per call, per row, per row x cell, extra per cell in small calls
        self._since_fit = 0.0  # engine ms observed since the last fit
        self.outliers = 0  # ticks that took more than twice the prediction, once the model is ready

    @property
    def ready(self) -> bool:
        return self._coef_now is not None

    @property
    def coef(self) -> np.ndarray | None:
        """ms per call, per row, per row x cell, extra per cell in small calls: the fit, fresh."""
        self._refresh()
        return self._coef_now

    def _refresh(self) -> None:
        """Refit when REFIT_MS of engine time came since the last fit. Lazily, when a prediction is
        asked for: a fit is 0.2-0.6 ms of the front's CPU, a node that only decodes asks only for its
        telemetry's once a second, and fitting as ticks came took a third of the front's CPU at one
        session (cProfile, CPU time): CPU the engine's threads need on a small host."""
        if self._since_fit >= REFIT_MS and self.samples >= MIN_SAMPLES:
            self._fit()

    def observe(self, tick: Shape, ms: float, sized: bool = False, decode_only: bool = False, steps: int = 1,
                drafted: bool = False) -> None:
        """A step that ran (`ms`, of a tick of `steps` such steps): `sized` when it carried prompt rows beside
        decode rows, sized to the target; `decode_only` when every row was a sequence's next token. `drafted`:
        drafts changed its rows (engine/drafts.py: draft rows added, or rows answered from an earlier tick's
        drafts), so it ran another shape than `tick`: it counts among the decode ticks the streams had, but
        teaches the fit nothing; taken as `tick`'s time it raised the correction and the sizing quantile, and a
        burst's prompts went in smaller chunks (docs/operating.md, under n_batch)."""
        if tick.rows <= 0 or ms <= 0:
            return
        if decode_only:
            size = tick.rows.bit_length()
            self._decode.setdefault(size, deque(maxlen=DECODE_TICKS)).append(ms)
            self._decode_ms[size] = _median(self._decode[size])
            self._cadence.setdefault(size, deque(maxlen=DECODE_TICKS)).append(ms * steps)
            self._cadence_ms[size] = _median(self._cadence[size])
        if drafted:
            return
        if self.ready:  # judged by the fit as it stands (refitting per tick is what the laziness saves)
            if ms > 2 * self._expected(tick, sized) + 5:
                self.outliers += 1
            elif sized:
                self._ratios.append(ms / self._fitted(tick))
                if len(self._ratios) >= 3:
                    median, high = np.quantile(self._ratios, [0.5, MISS_QUANTILE])
                    self.correction, self.correction_bound = (float(np.clip(v, *CORRECTION)) for v in (median, high))
        self._shapes.setdefault(tick.rows.bit_length(), deque(maxlen=self._per_shape)).append((tick, ms))
        self._since_fit += ms
        if not self.ready and self.samples >= MIN_SAMPLES:
            self._fit()

    def describe(self) -> dict:
        """The fitted costs, for telemetry: what a tick costs here, and how often one ran far over."""
        c = self.coef if self.ready else (None, None, None, None)
        return {"ms_per_call": c[0] and round(float(c[0]), 3), "ms_per_row": c[1] and round(float(c[1]), 4),
                "ms_per_row_cell": c[2] and float(c[2]), "ms_per_row_cell_small_call_extra": c[3] and float(c[3]),
                "correction": round(self.correction, 3), "correction_bound": round(self.correction_bound, 3),
                "samples": self.samples, "outliers_total": self.outliers}

    @property
    def samples(self) -> int:
        return sum(len(d) for d in self._shapes.values())

    def predict(self, tick: Shape, sized: bool = False) -> float:
        """The time a tick is expected to take."""
        self._refresh()
        return self._expected(tick, sized)

    def _expected(self, tick: Shape, sized: bool) -> float:
        return self._fitted(tick) * (self.correction if sized else 1.0)

    def decode_tick_ms(self, tick: Shape) -> float:
        """What a decode-only tick like `tick` takes: measured (the median of the last ones of about its
        rows: the same power of two, or the next one either side), the fit's prediction where none like it
        ran. Measured, because the fit, which serves prompt-sized ticks, can be far off at a handful of rows;
        but not from ticks of other sizes: while 64 prompts came in, every tick carried some, and the
        one-row warm-up ticks stood for 14-38 decoding rows, so the target (a few times a 15 ms tick, where
        the decode rows alone took 40-75 ms) left room for one or two 32-token prompts a tick."""
        ms = self.measured_decode_ms(tick.rows)
        return self.predict(tick) if ms is None else ms

    def measured_decode_ms(self, rows: int) -> float | None:
        """What a step of decode-only ticks of about `rows` rows took lately (their median), None where none ran."""
        return _nearest(self._decode_ms, rows)

    def cadence_ms(self, tick: Shape) -> float:
        """How far apart decode-only ticks like `tick` delivered their tokens lately: a tick, all its steps
        (core/steps.py), the median of the last ones of about its rows; a step where none ran."""
        ms = _nearest(self._cadence_ms, tick.rows)
        return self.decode_tick_ms(tick) if ms is None else ms

    def bound(self, tick: Shape) -> float:
        """A sized tick's time, as ticks of its kind have run at worst lately (nine in ten under it)."""
        self._refresh()
        return self._fitted(tick) * self.correction_bound

    def _fitted(self, tick: Shape) -> float:
        c, r, a, s = self._coef  # plain floats: the capacity replay predicts hundreds of ticks per estimate
        return c * tick.calls + r * tick.rows + a * tick.attn + s * tick.attn_small

    def _fit(self) -> None:
        self._since_fit = 0.0
        pts = [p for d in self._shapes.values() for p in d]
        x, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts])
        # relative errors, not ms: a 2 ms decode tick is fitted as closely as a 400 ms prompt tick, since the
        # estimates add up many small ticks (fitted in ms, a decode tick came out 3-4x its measured time)
        w = 1.0 / np.maximum(y, 1e-3)
        x, y = x * w[:, None], y * w
        coef = _nonneg_lstsq(x, y)
        for _ in range(3):  # leave out what fits far worse than the rest, fit again
            err = np.abs(x @ coef - y) / np.maximum(x @ coef, 1e-3)
            keep = err <= max(4 * np.median(err), 0.05)
            if keep.sum() < MIN_SAMPLES:
                break
            coef = _nonneg_lstsq(x[keep], y[keep])
        if coef[1] <= 0:  # every tick had the same rows: no slope to learn yet
            return
        self._coef_now, self._coef = coef, tuple(float(v) for v in coef)


def rows_per_call(cost: TickCost) -> int:
    """What one more llama_decode call costs, in prompt rows: a prompt chunk that starts beside
    another on streams pays it."""
    coef = cost.coef
    if coef is None or coef[1] <= 0:
        return 0
    return int(np.ceil(coef[0] / coef[1]))


def _nearest(by_size: dict[int, float], rows: int) -> float | None:
    """The figure kept for ticks of about `rows` rows (the same power of two, or the next one either side)."""
    size = rows.bit_length()
    near = [k for k in by_size if abs(k - size) <= 1]
    return by_size[min(near, key=lambda k: abs(k - size))] if near else None


def _median(xs) -> float:
    """The median of a few floats (a deque of 16): np.median costs ~0.1 ms of overhead here, this ~2 us."""
    v = sorted(xs)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a negative cost is noise, not physics): a feature
    whose coefficient comes out negative is dropped and the rest refitted. The small-call excess
    (the last) is pulled towards 0 by a penalty a tenth of its column's size: ticks that tell it apart
    outweigh it, ticks that cannot (every small call also the only attention seen) leave it at 0."""
    w = PRIOR * np.linalg.norm(x[:, -1])
    x, y = np.vstack([x, np.eye(x.shape[1])[-1] * w]), np.append(y, 0.0)
    cols = list(range(x.shape[1]))
    while True:
        c, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (c >= 0).all() or len(cols) == 1:
            out = np.zeros(x.shape[1])
            out[cols] = np.maximum(c, 0)
            return out
        cols.pop(int(np.argmin(c)))


def fill(room: int, pending: list[int], decoding: bool, streams: bool, per_call: int) -> list[int]:
    """The prompt tokens each prompt in line (`pending` tokens left each) computes in a tick with
    `room`, in order, the first taking what it can. On streams each chunk is a llama_decode call of
    its own, and llama.cpp's CPU flash attention works in tiles of TILE_ROWS rows: a call under
    TILE_ROWS rows attends row by row, several times slower per cell deep in a prompt, and a last,
    partial tile costs a whole one (`python -m benchmarks ticks`). So there a chunk that does not finish
    its prompt leaves at least TILE_ROWS behind and no mostly empty last tile, and a prompt starts
    beside another only with room for a tile. `decoding`: decode rows share the tick, and another call
    costs `per_call` rows of the room (rows_per_call); a chunk as long as one before it shares that one's
    call (llama_calls), so 64 short prompts arriving together go in few calls."""
    out: list[int] = []
    for p in pending:
        if out:
            if decoding and min(p, room) not in out:
                room -= per_call
            if room <= 0 or (streams and room < min(TILE_ROWS, p)):
                break
        n = min(p, room)
        if n <= 0:
            break
        if n < p and streams:
            if p - n < TILE_ROWS <= p - TILE_ROWS:  # leave a whole tile, not a sliver
                n = p - TILE_ROWS
            elif n > TILE_ROWS and n % TILE_ROWS < TILE_ROWS // 2:
                n -= n % TILE_ROWS
        out.append(n)
        room -= n
        if n < p:
            break
    return out


def deterministic_chunk(room: int, start: int, n_prompt: int, end: int) -> int:
    """Deterministic mode's next chunk of a sequence from position `start` (of `end` known): each cell is
    computed by the attention kernel a cold run gives it (engine/invariant.py). A prompt of >= TILE_ROWS
    tokens goes in chunks of >= TILE_ROWS rows (the tiled kernel), leaving 0 or >= TILE_ROWS behind,
    even if that means up to 2 * TILE_ROWS - 1 rows where `room` is smaller; everything else (a shorter
    prompt, the generated tokens a restart recomputes) in chunks under TILE_ROWS (the per-row kernel a
    decode row takes).

    Where the room holds one tile, the prompt's rows past its whole tiles go beside the next tile at once
    (or, more than the room and half a tile, half now and half next), and every later chunk is one tile:
    a room that small only shrinks deeper in the prompt, where each row costs more, and cut greedily the
    prompt ended on a forced tail of 65-127 rows there, a partial tile computed whole at the deepest
    positions: the burst's worst ticks (evidence/tick-pacing.md). A wider room takes what it holds, and
    leaves two tiles rather than a tail of 65-127 rows (or, with less than three tiles left, the two
    chunks take half each)."""
    if n_prompt >= TILE_ROWS and start < n_prompt:
        left, room = n_prompt - start, max(room, TILE_ROWS)
        if left <= room or left < 2 * TILE_ROWS:
            return left
        if room < 2 * TILE_ROWS:
            if left < 3 * TILE_ROWS:
                return -(-left // 2)
            rest = left % TILE_ROWS  # beside the next tile, or, where the room holds neither, half of it
            return TILE_ROWS + (rest if TILE_ROWS + rest <= room or 2 * rest <= TILE_ROWS else -(-rest // 2))
        n = min(room, left - TILE_ROWS)
        if TILE_ROWS < left - n < 2 * TILE_ROWS:  # leave two tiles, or where there is not that much, halves
            n = left - 2 * TILE_ROWS if left - 2 * TILE_ROWS >= TILE_ROWS else -(-left // 2)
        return n
    return max(0, min(room, end - start, TILE_ROWS - 1))


def fill_deterministic(room: int, prompts: list[tuple[int, int, int]], decoding: bool, per_call: int) -> list[int]:
    """`fill` for deterministic mode: each prompt in line ((position, tokens left, prompt length)) takes
    `deterministic_chunk`; the first may go over `room` to keep its chunk whole, the others may not; a
    chunk as long as one before it shares that one's call."""
    out: list[int] = []
    for pos, left, n_prompt in prompts:
        n = deterministic_chunk(room, pos, n_prompt, pos + left)
        if out and decoding and n not in out:
            room -= per_call
            n = deterministic_chunk(room, pos, n_prompt, pos + left)
        if n <= 0 or (out and n > room):
            break
        out.append(n)
        room -= n
    return out


