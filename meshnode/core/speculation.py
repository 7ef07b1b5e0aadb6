"""How many draft tokens a tick carries: the policy of speculative decoding, with no I/O.

A draft is verified where it is made: a decoding sequence's chunk is its token and K drafts, one
llama_decode computes K + 1 rows, and the target's own sampler takes each position in turn; the run of
drafts it agrees with is kept (engine/drafts.py). The front still asks one token a tick per session, and
the engine answers the next ticks from the kept run without computing: so a drafted tick pays when the
ticks after it need no llama_decode at all, which at R sessions needs every one of them to be ahead. What
a tick costs by its rows (`RowCost`, learned from the engine's own ticks) and how likely each session's
next drafts are right (`Guesses`) give the expected tokens per millisecond of each K (`draft_len`); K = 0
wins where drafts do not pay, which is every tick of a busy node on a CPU, where a row costs what a
decode does, and every tick of free text, whose next token a lookup rarely knows.

A lookup's guess is checked against every token a session samples, drafted or not (a guess costs no
row), so what the policy knows of a session never depends on having paid to draft for it: where the
guesses turn right (a copy begins) drafting starts, where they stop being right it stops. A guess is the
likelier right the longer the match it follows (`Guesses`): llama-server's ngram-mod drafts long only
behind a long match for the same reason.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from meshnode.core.costmodel import TILE_ROWS

MODES = ("off", "lookup", "draft", "auto")
MAX_DRAFTS = TILE_ROWS - 2  # a drafted chunk stays below the flash-attention tile: a decode row's kernel
PRIOR = (1.0, 1.0)  # an unknown session's drafts: (right, wrong) pseudo-counts
DECAY = 0.5  # what a verdict weighs a drafted tick later: prompt lookup is right in runs (a copy) and wrong in runs
SERVED_MS = 0.3  # a tick answered from kept drafts: the front's round trip, no llama_decode
UNLIKELY = 0.03  # a draft this unlikely to be reached and right is never worth its row: K stops before it
LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the Ks `could_pay` tries (it runs every tick)


def in_effect(mode: str, kv_layout: str) -> tuple[str, str]:
    """The mode a node runs with these settings, and why it is not the one asked for ("" when it is)."""
    if mode != "off" and kv_layout != "streams":
        return "off", "spec: off on the unified KV layout (draft cells could take cells another session was promised)"
    return mode, ""


@dataclass
class Acceptance:
    """A session's record of drafted positions the sampler agreed with (right) or not (wrong): each drafted
    position up to and including the first wrong one is a verdict; the ones after it were never asked. For
    a draft model's guesses, which cost a decode of their own to make."""
    right: float = PRIOR[0]
    wrong: float = PRIOR[1]

    def record(self, accepted: int, drafted: int) -> None:
        self.right = self.right * DECAY + accepted
        self.wrong = self.wrong * DECAY + (1 if accepted < drafted else 0)

    @property
    def rate(self) -> float:
        """The chance that a drafted position is right given the ones before it were."""
        return self.right / (self.right + self.wrong)


MATCHES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # the lower bounds of the buckets of match lengths counted in
PRIOR_WEIGHT = 3.0  # pseudo-counts of a bucket's prior (every session's rate for it, or prior_right)
OWN_DECAY = 0.9  # a session's counts: recent text counts more (a copy ends, a list begins)
SHARED_DECAY = 0.995


def prior_right(match: int) -> float:
    """A guess's chance of being right behind a `match`-token match before anything is known: most guesses
    behind 2 tokens are wrong, most behind 16 right (measured on SmolLM2's chats and code edits: 0.55 at 2-3,
    0.7 at 4-5, 0.9 at 8-19, 0.96 past 20); pessimistic, since every session's counts soon replace it."""
    return 1.0 - 0.9 / (1.0 + match / 4.0)


class Guesses:
    """How often a lookup's guess of a session's next token was right, by the length of the match it came
    from (the longer the text it follows, the likelier the copy goes on: a code edit's unchanged lines, a
    list's repeated form). A session's own counts (decaying) are drawn towards every session's (`shared`),
    which are drawn towards prior_right."""

    def __init__(self, shared: "Guesses | None" = None):
        self.right, self.wrong = [0.0] * len(MATCHES), [0.0] * len(MATCHES)
        self.shared = shared

    def record(self, match: int, right: bool) -> None:
        b = max(bisect_right(MATCHES, match) - 1, 0)
        decay = OWN_DECAY if self.shared is not None else SHARED_DECAY
        self.right[b] = self.right[b] * decay + right
        self.wrong[b] = self.wrong[b] * decay + (not right)
        if self.shared is not None:
            self.shared.record(match, right)

    def p(self, match: int) -> float:
        """The chance that a guess behind a `match`-token match is right."""
        b = max(bisect_right(MATCHES, match) - 1, 0)
        base = self.shared.p(match) if self.shared is not None else prior_right(MATCHES[b])
        r, w = self.right[b], self.wrong[b]
        return (r + PRIOR_WEIGHT * base) / (r + w + PRIOR_WEIGHT)

    def chain(self, match: int, k: int) -> list[float]:
        """P(the first j guesses are all right) for j = 1..k: each right one makes the match a token longer."""
        out, c = [], 1.0
        for j in range(k):
            c *= self.p(match + j)
            if c < UNLIKELY:
                break
            out.append(c)
        return out


YIELD_PRIOR = 2.0  # pseudo-skips on each side of a session's yield: its first drafted tick moves it, not alone
YIELD_DECAY = 0.97  # per computed tick: a yield's evidence halves in ~23 ticks, so drafting that stopped comes back


class Yield:
    """How many of the skips a session's drafted ticks were expected to give (their chains' sums) they gave.
    `Guesses` learns from each tick's first guess; behind it, free text leaves a matched phrase within a few
    tokens where a copy goes on, so in a chat the chain promises runs that end sooner (measured on SmolLM2:
    4-8-token matches drafted 15 deep for ~2 kept, each such tick 5x a decode). The chain is scaled by it
    (never above 1), so a session whose drafts keep falling short stops drafting; the evidence fades tick
    by tick, so a copy that begins later is drafted again."""

    def __init__(self):
        self.expected = self.got = 0.0

    def tick(self) -> None:
        self.expected *= YIELD_DECAY
        self.got *= YIELD_DECAY

    def record(self, expected: float, got: int) -> None:
        self.expected += expected
        self.got += got

    @property
    def factor(self) -> float:
        return min(1.0, (self.got + YIELD_PRIOR) / (self.expected + YIELD_PRIOR))


class RowCost:
    """What a tick of n rows costs, in ms, as ticks in service take it. Seeded by the engine's start-up
    calibration (`points`), which times each shape warm, ticks of one shape in a row; in service a drafted
    tick's shape comes between single rows, and costs more (llama.cpp builds the graph again, the caches
    hold another shape's data). So the first tick seen of a row count replaces its seed, later ones move
    it a step at a time, and a count not seen yet is its seed scaled by how far seen ticks ran from theirs.
    Never less than a smaller count's: a row more never makes a tick cheaper, whatever the noise says.
    Linear between known counts and past the last two; n rows cost n before any is known (only the ratios
    matter to `draft_len`)."""

    def __init__(self, points=()):
        self._seed: dict[int, float] = {}
        top = 0.0  # one timing a shape, noisy (the first of its graph): a count timed cheaper than fewer rows
        for rows, ms in sorted(points):  # takes theirs
            top = self._seed[rows] = max(top, ms)
        self._ms: dict[int, float] = {}  # row count -> ms in service
        self._drift = 1.0  # how many times their seeds the ticks of several rows seen in service take
        self._known: dict[int, float] = {}

    def observe(self, rows: int, ms: float, weight: float = 0.2) -> None:
        old = self._ms.get(rows)
        self._ms[rows] = ms if old is None else old + weight * (ms - old)
        self._known.clear()  # asked each tick for every K: figures from one observation to the next
        seen = [v / _between(self._seed, n) for n, v in self._ms.items() if n > 1] if self._seed else []
        self._drift = sum(seen) / len(seen) if seen else 1.0

    def __call__(self, rows: int) -> float:
        ms = self._known.get(rows)
        if ms is not None:
            return ms
        if not self._ms and not self._seed:
            return float(rows)
        if rows in self._ms:
            ms = self._ms[rows]
        elif self._seed:
            ms = _between(self._seed, rows) * (self._drift if rows > 1 else 1.0)
        else:
            ms = _between(self._ms, rows)
        ms = self._known[rows] = max([ms, *(v for n, v in self._ms.items() if n < rows)])
        return ms


def _between(ms: dict[int, float], rows: int) -> float:
    """ms of `rows` rows from the known counts' ms: theirs, linear between two, past the last two (or
    proportional to the only one)."""
    if rows in ms:
        return ms[rows]
    known = sorted(ms)
    if len(known) == 1:
        return ms[known[0]] * rows / known[0]
    lo = max([k for k in known if k < rows], default=None)
    hi = min([k for k in known if k > rows], default=None)
    if lo is None:
        lo, hi = known[0], known[1]
    elif hi is None:
        lo, hi = known[-2], known[-1]
    return max(ms[lo] + (ms[hi] - ms[lo]) / (hi - lo) * (rows - lo), 1e-3)


def expected_skips(rates: list, k: int) -> float:
    """Ticks after a drafted one that need no llama_decode: the j-th does where every session had its first
    j drafts right (sessions independent). A rate is a session's chance of each draft being right; a chain
    (Guesses.chain) its chance of the first j being right, j = 1, 2, ..."""
    return _skips(rates, k)[-1] if k > 0 else 0.0


def _skips(rates: list, k_max: int) -> list[float]:
    """expected_skips for every K from 1 to k_max, in one pass."""
    every = [1.0] * k_max
    for a in rates:
        if isinstance(a, (int, float)):
            c = 1.0
            for j in range(k_max):
                c *= a
                every[j] *= c
        else:
            for j in range(k_max):
                every[j] *= a[j] if j < len(a) else 0.0
    out, total = [], 0.0
    for e in every:
        if e < UNLIKELY and out:
            break
        total += e
        out.append(total)
    return out


def draft_len(rates: list, base_rows: int, cost: RowCost, k_max: int, k_min: int = 1,
              free: int = 0, per_draft_ms: float = 0.0) -> int:
    """The drafts per session for a tick of len(rates) decoding sessions that all may draft: the K in
    [k_min, k_max] (or 0) with the most tokens per ms over a drafted tick and the ticks it answers.
    `rates`: each session's rate or chain (expected_skips). `base_rows`: the rows the tick computes without
    drafts (deterministic mode's padding included), `free`: drafts that cost nothing (a lone row's padding
    row is a draft instead): at least that many. `per_draft_ms`: what making one draft costs (a draft
    model's decode step; prompt lookup's is nothing)."""
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


def could_pay(sessions: int, base_rows: int, cost: RowCost, k_max: int, k_min: int = 1) -> bool:
    """Whether drafts that are always right would pay at all in a tick of this many sessions: where they would
    not (a busy node on a CPU), nobody needs to look for drafts."""
    base = 1.0 / cost(base_rows)
    return any((1.0 + k) / (cost(sessions * (k + 1)) + k * SERVED_MS) > base
               for k in LADDER if k_min <= k <= k_max)
