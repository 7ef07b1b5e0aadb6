"""How many draft tokens a tick carries: the policy of speculative decoding, with no I/O.

A draft is verified where it is made: a decoding sequence's chunk is its token and K drafts, one
llama_decode computes K + 1 rows, and the target's own sampler takes each position in turn; the run of
drafts it agrees with is kept (engine/drafts.py). The front still asks one token a tick per session, and
the engine answers the next ticks from the kept run without computing: so a drafted tick pays when the
ticks after it need no llama_decode at all, which at R sessions needs every one of them to be ahead. What
a tick costs by its rows (`RowCost`, learned from the engine's own ticks) and how often each session's
drafts were right (`Acceptance`) give the expected tokens per millisecond of each K (`draft_len`); K = 0
wins where drafts do not pay, which is every tick of a busy node on a CPU, where a row costs what a
decode does.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshnode.core.costmodel import TILE_ROWS

MODES = ("off", "lookup", "draft", "auto")
MAX_DRAFTS = TILE_ROWS - 2  # a drafted chunk stays below the flash-attention tile: a decode row's kernel
PRIOR = (1.0, 1.0)  # an unknown session's drafts: (right, wrong) pseudo-counts
DECAY = 0.5  # what a verdict weighs a drafted tick later: prompt lookup is right in runs (a copy) and wrong in runs
SERVED_MS = 0.3  # a tick answered from kept drafts: the front's round trip, no llama_decode


def in_effect(mode: str, kv_layout: str) -> tuple[str, str]:
    """The mode a node runs with these settings, and why it is not the one asked for ("" when it is)."""
    if mode != "off" and kv_layout != "streams":
        return "off", "spec: off on the unified KV layout (draft cells could take cells another session was promised)"
    return mode, ""


@dataclass
class Acceptance:
    """A session's record of drafted positions the sampler agreed with (right) or not (wrong): each drafted
    position up to and including the first wrong one is a verdict; the ones after it were never asked."""
    right: float = PRIOR[0]
    wrong: float = PRIOR[1]

    def record(self, accepted: int, drafted: int) -> None:
        self.right = self.right * DECAY + accepted
        self.wrong = self.wrong * DECAY + (1 if accepted < drafted else 0)

    @property
    def rate(self) -> float:
        """The chance that a drafted position is right given the ones before it were."""
        return self.right / (self.right + self.wrong)


class RowCost:
    """What a tick of n rows costs, in ms: the mean of ticks of each row count seen, seeded by the engine's
    start-up calibration, linear between known counts and past the last two; n rows cost n before any is
    known (only the ratios matter to `draft_len`)."""

    def __init__(self, points=()):
        self._ms: dict[int, float] = {}
        for rows, ms in points:
            self.observe(rows, ms)

    def observe(self, rows: int, ms: float, weight: float = 0.2) -> None:
        old = self._ms.get(rows)
        self._ms[rows] = ms if old is None else old + weight * (ms - old)

    def __call__(self, rows: int) -> float:
        known = sorted(self._ms)
        if not known:
            return float(rows)
        if rows in self._ms:
            return self._ms[rows]
        if len(known) == 1:
            return self._ms[known[0]] * rows / known[0]
        lo = max([k for k in known if k < rows], default=None)
        hi = min([k for k in known if k > rows], default=None)
        if lo is None:
            lo, hi = known[0], known[1]
        elif hi is None:
            lo, hi = known[-2], known[-1]
        slope = (self._ms[hi] - self._ms[lo]) / (hi - lo)
        return max(self._ms[lo] + slope * (rows - lo), 1e-3)


def expected_skips(rates: list[float], k: int) -> float:
    """Ticks after a drafted one that need no llama_decode: the j-th does where every session had its first
    j drafts right (sessions independent, each position right with its session's rate)."""
    return _skips(rates, k)[-1] if k > 0 else 0.0


def _skips(rates: list[float], k_max: int) -> list[float]:
    """expected_skips for every K from 1 to k_max, in one pass: the j-th term is the j-th power of the
    product of the rates."""
    every = 1.0
    for a in rates:
        every *= a
    out, run, total = [], 1.0, 0.0
    for _ in range(k_max):
        run *= every
        total += run
        out.append(total)
    return out


def draft_len(rates: list[float], base_rows: int, cost: RowCost, k_max: int, k_min: int = 1,
              free: int = 0, per_draft_ms: float = 0.0) -> int:
    """The drafts per session for a tick of len(rates) decoding sessions that all may draft: the K in
    [k_min, k_max] (or 0) with the most tokens per ms over a drafted tick and the ticks it answers.
    `base_rows`: the rows the tick computes without drafts (deterministic mode's padding included), `free`:
    drafts that cost nothing (a lone row's padding row is a draft instead): at least that many.
    `per_draft_ms`: what making one draft costs (a draft model's decode step; prompt lookup's is nothing)."""
    r = len(rates)
    if r == 0 or k_max <= 0:
        return 0
    best_k, best = 0, 1.0 / cost(base_rows)
    for k, skips in enumerate(_skips(rates, k_max), 1):
        if k < k_min:
            continue
        rate = (1.0 + skips) / (cost(r * (k + 1)) + skips * SERVED_MS + k * per_draft_ms)
        if rate > best:
            best_k, best = k, rate
    return max(best_k, min(free, k_max))
