"""Speculative decoding in the engine: drafts verified in the tick's own llama_decode, never a changed token.

A decoding sequence's chunk becomes its token and K drafts, rows of the same sequence at the next
positions (on streams: one chunk, the shape a prompt or a restart's re-prefill takes). Position i is
sampled from its own row with the draw it would have had one tick at a time (`draw + i`, penalties over
the tokens before it), so where the drafts are right the tokens are the ones decoding one by one gives;
in deterministic mode a row's bits do not depend on the rows beside it (engine/invariant.py), so they are
the same bits too. The first position whose sample differs from the draft ends the run: its sample is
still good (its row saw only right tokens), the cells after it go through the engine's one cut
(`trim_kv`). The front asks a token a tick as before; the kept samples answer the ticks that follow
(`Ahead`), with no llama_decode while every session in the tick is ahead.

Drafts come from prompt lookup (`Lookup`: the tokens that followed the earlier occurrence of the
sequence's last tokens that matches the most of them, prompt and output alike). K comes from the cost
model (core/speculation.py) in `auto`, from how often the lookup's guesses behind a match of this length
were right (each tick's guess is checked against the sample, drafted or not: `observe`, `_learn`), scaled
by what the session's drafted ticks gave of what they promised (`Yield`); it is
the most allowed in `lookup`. A deterministic lone row that needs a padding row (invariant.pads) gets a
draft instead (the lookup's, else the token itself).
Not drafted: sessions with a response_format (their matcher would have to step back), prompt chunks,
and the unified KV layout (draft cells could take cells another session was promised).
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import NamedTuple, Protocol

import numpy as np

from meshnode.core.speculation import MAX_DRAFTS, Acceptance, Guesses, RowCost, Yield, could_pay, draft_len
from meshnode.core.types import SeqChunk, StepResult

KEY = 2  # tokens of the suffix an occurrence is found by
CANDIDATES = 8  # the latest occurrences of a key kept: the one with the longest match is followed
MAX_MATCH = 64  # a match is measured up to this many tokens


class Ahead(NamedTuple):
    """A tick computed already from a right draft: the chunk it must be (one token at `pos`, `token`, draw
    `draw`) and what it sampled."""
    pos: int
    token: int
    draw: int
    sampled: int
    logprobs: tuple | None


class Lookup:
    """Per sequence, where each 2-token run of its history ended (the position of the token after it), the
    latest CANDIDATES of each, indexed as the history grows."""

    def __init__(self):
        self._ends: dict[int, dict[tuple, list[int]]] = {}
        self._upto: dict[int, int] = {}  # positions of the history indexed so far
        self.match: dict[int, int] = {}  # sequence -> the length of the match its last proposal follows

    def propose(self, seq: int, tokens: list[int], k: int) -> list[int]:
        """Up to k drafts to follow `tokens` (the sequence so far): what followed the earlier occurrence of
        its last tokens that matches the most of them (the latest of equals), continued through the drafts
        themselves (a repeating pattern repeats on); [] where its last two tokens never came before."""
        index = self._ends.setdefault(seq, {})
        n = len(tokens)
        for e in range(max(self._upto.get(seq, 0), KEY - 1), n - 1):  # an end with a token after it
            ends = index.setdefault((tokens[e - 1], tokens[e]), [])
            ends.append(e + 1)
            if len(ends) > CANDIDATES:
                del ends[0]
        self._upto[seq] = max(self._upto.get(seq, 0), n - 1)
        self.match.pop(seq, None)
        ends = index.get((tokens[n - 2], tokens[n - 1])) if n >= KEY else None
        if not ends or k <= 0:
            return []
        best, q = 0, 0
        for e in reversed(ends):
            m = KEY
            while m < MAX_MATCH and e - 1 - m >= 0 and tokens[e - 1 - m] == tokens[n - 1 - m]:
                m += 1
            if m > best:
                best, q = m, e
        self.match[seq] = best
        out: list[int] = []
        for j in range(k):
            i = q + j
            out.append(tokens[i] if i < n else out[i - n])
        return out

    def forget(self, seq: int, keep: int = 0) -> None:
        """The sequence's history from position `keep` on was dropped or replaced: index it again."""
        if keep <= self._upto.get(seq, 0):  # an index entry names positions up to _upto
            self._ends.pop(seq, None)
            self._upto.pop(seq, None)
            self.match.pop(seq, None)


class DraftHost(Protocol):
    """What drafting asks of the engine that verifies its drafts (engine/llama.py's LlamaEngine): the
    sequences' tokens and limits, the sampler and the tick's logits, and the engine's one KV cut."""
    n_ctx_seq: int
    n_batch: int
    eog: list[int]

    def fed(self, seq: int) -> list[int]: ...  # the tokens fed to the sequence, by position (the engine's list)

    def constrained(self, seq: int) -> bool: ...

    def pad_rows(self, chunks: list) -> int: ...  # deterministic mode's padding rows for these decode rows

    def sample(self, c: SeqChunk, logits: np.ndarray, res: StepResult) -> None: ...

    def row_logits(self, row: int) -> np.ndarray: ...

    def trim_kv(self, seq: int, n: int) -> None: ...


class Speculator:
    """The engine's drafting: plans a tick's drafted chunks, verifies them from the tick's logits, and answers
    later ticks from what it kept. Owned by the engine (`LlamaEngine.drafts`); it reaches the engine only
    through `DraftHost`. `streams`: drafts only on the streams layout (core/speculation.py, in_effect)."""

    def __init__(self, host: DraftHost, mode: str, k_max: int, k_min: int, model=None, streams: bool = True):
        """`model`: a DraftModel (engine/draftmodel.py), the source where the lookup finds nothing, or the
        only one in `draft` mode."""
        self.host, self.streams = host, streams
        self.mode, self._k_max, self._k_min = mode, min(k_max, MAX_DRAFTS), k_min
        self.lookup, self.ahead = Lookup(), {}  # sequence -> deque of Ahead: its next ticks, computed
        self._model_drafts, self._source = model, "lookup"
        self._acceptance: dict[int, Acceptance] = {}  # sequence -> the draft model's record for it
        self._shared_guesses = Guesses()  # every session's lookup guesses: a new session's prior
        self._guesses: dict[int, Guesses] = {}  # sequence -> its lookup's guesses, right and wrong
        self._guessed: dict[int, tuple[int, int]] = {}  # this tick's undrafted rows: (the lookup's guess, match)
        self._looked: dict[int, tuple[int, int]] = {}  # this tick's drafted rows: (the lookup's own drafts, match)
        # sequence -> what its drafted ticks gave of what they promised
        self._yields: defaultdict[int, Yield] = defaultdict(Yield)
        self._expected: dict[int, float] = {}  # this tick's drafted rows: the skips their chains promised
        self.row_cost = RowCost()

    def plan(self, chunks: list) -> dict[int, SeqChunk]:
        """The decode chunks that carry drafts this tick, by sequence, all with the same K (on streams one
        llama_decode call takes chunks of one length)."""
        self._guessed, self._looked, self._expected = {}, {}, {}
        rows = [c for c in chunks if len(c.tokens) == 1 and c.draw >= 0 and not c.embed]
        if not rows or self.mode == "off" or len(rows) < len(chunks) or not self.streams:
            return {}
        if any(self.host.constrained(c.seq_id) or c.sampling is not None for c in rows):
            return {}  # a row that cannot be ahead: no tick can be skipped
        room = min(self.host.n_ctx_seq - 1 - c.pos for c in rows)
        k_max = min(self._k_max, room, (self.host.n_batch - len(rows)) // len(rows))
        pads = self.host.pad_rows(rows)  # deterministic mode's padding rows for the rows as they are
        free = 1 if pads and len(rows) == 1 else 0
        if (self.mode == "auto" and not free and self._model_drafts is None
                and not could_pay(len(rows), len(rows) + pads, self.row_cost, k_max, self._k_min)):
            return {}  # nobody looks: even drafts that are always right would not pay
        found = {c.seq_id: self._propose(c, k_max) for c in rows}
        for c in rows:  # a computed tick: what its drafts gave before fades a step
            self._yields[c.seq_id].tick()
        model = self._model_drafts is not None and (self.mode == "draft" or not all(found.values()))
        source = "model" if model else "lookup"
        self._source = source
        if self.mode in ("lookup", "draft"):
            k = k_max if model or all(found.values()) else free
        elif not model and not all(found.values()):
            k = min(free, k_max)
        elif model:
            rates = [self._acceptance.setdefault(c.seq_id, Acceptance()).rate for c in rows]
            per_draft = self._model_drafts.step_ms or self.row_cost(len(rows))
            k = draft_len(rates, len(rows) + pads, self.row_cost, k_max, self._k_min, 0, per_draft)
            model = k > 0  # a free row alone is not worth a draft model's step: a guess fills it
            k, self._source = max(k, min(free, k_max)), "model" if model else "lookup"
        else:
            chains = [self._guesses_of(c.seq_id).chain(self._match(c.seq_id), k_max) for c in rows]
            yields = [self._yields[c.seq_id] for c in rows]
            k = draft_len([[p * y.factor for p in ch] for ch, y in zip(chains, yields)], len(rows) + pads,
                          self.row_cost, k_max, self._k_min, free)
            self._expected = {c.seq_id: sum(ch[:k]) for c, ch in zip(rows, chains)}
        if k > 0 and model:
            seen = {c.seq_id: self.host.fed(c.seq_id)[:c.pos] + [int(c.tokens[0])] for c in rows}
            found = self._model_drafts.propose(seen, k) or {s: [] for s in seen}
        elif self._source == "lookup":  # what the lookup guessed, to check against what is sampled
            if k <= 0:
                self._guessed = {s: (d[0], self._match(s)) for s, d in found.items() if d}
            self._looked = {s: (min(len(d), k), self._match(s)) for s, d in found.items()}
        if k <= 0:
            return {}
        out = {}
        for c in rows:
            d = (found[c.seq_id] or [])[:k]
            d += [d[-1] if d else int(c.tokens[0])] * (k - len(d))  # a short or missing lookup: a guess
            out[c.seq_id] = SeqChunk(c.seq_id, c.pos, np.array([int(c.tokens[0]), *d], np.int32), draw=c.draw)
        return out

    def _propose(self, c: SeqChunk, k: int) -> list[int]:
        """The lookup's drafts after the chunk's token: the sequence's history gets the token for the call
        (no copy of a long history every tick)."""
        h = self.host.fed(c.seq_id)
        if len(h) != c.pos:
            return self.lookup.propose(c.seq_id, h[:c.pos] + [int(c.tokens[0])], k)
        h.append(int(c.tokens[0]))
        try:
            return self.lookup.propose(c.seq_id, h, k)
        finally:
            h.pop()

    def _guesses_of(self, seq: int) -> Guesses:
        g = self._guesses.get(seq)
        if g is None:
            g = self._guesses[seq] = Guesses(self._shared_guesses)
        return g

    def _match(self, seq: int) -> int:
        return self.lookup.match.get(seq, KEY)

    def observe(self, res: StepResult) -> None:
        """This tick's samples of rows computed without drafts, against what the lookup guessed for them."""
        for s, (guess, match) in self._guessed.items():
            if s in res.tokens:
                self._guesses_of(s).record(match, res.tokens[s] == guess)

    def verify(self, c: SeqChunk, first: int, res: StepResult) -> None:
        """A drafted chunk whose rows start at batch row `first`: the samples of its positions in turn while
        each is the next draft; the first sample into `res`, the rest kept for the ticks that ask for them,
        the cells past the last right draft cut."""
        toks, k = c.tokens, len(c.tokens) - 1
        self.host.sample(SeqChunk(c.seq_id, c.pos, toks[:1], draw=c.draw), self.host.row_logits(first), res)
        res.drafted += k
        if c.seq_id not in res.tokens:  # failed (no sampler can go on): nothing to keep
            self.host.trim_kv(c.seq_id, c.pos + 1)
            return
        kept, prev, lp = deque(), res.tokens[c.seq_id], None
        i = 0
        while i < k and prev == toks[i + 1] and prev not in self.host.eog:
            i += 1
            step = StepResult()
            row = SeqChunk(c.seq_id, c.pos, toks[:i + 1], draw=c.draw + i)
            self.host.sample(row, self.host.row_logits(first + i), step)
            prev, lp = step.tokens[c.seq_id], step.logprobs.get(c.seq_id)
            kept.append(Ahead(c.pos + i, int(toks[i]), c.draw + i, prev, lp))
        if self._source == "model":
            self._acceptance.setdefault(c.seq_id, Acceptance()).record(i, k)
        else:
            self._learn(c.seq_id, i, k)
            if c.seq_id in self._expected:
                self._yields[c.seq_id].record(self._expected[c.seq_id], i)
        self.host.trim_kv(c.seq_id, c.pos + 1 + i)
        if kept:
            self.ahead[c.seq_id] = kept

    def _learn(self, seq: int, right: int, drafted: int) -> None:
        """A drafted chunk's verdicts on the lookup's own drafts (not the guesses that filled a short one): the
        first `right` of `drafted` were, each right one making the match a token longer."""
        looked, match = self._looked.get(seq, (0, KEY))
        g = self._guesses_of(seq)
        for j in range(min(right + 1, looked)):
            g.record(match + j, j < right)

    def answered(self, chunks: list, res: StepResult) -> list:
        """The chunks left to compute: one that is a tick a draft computed already is answered from it; a
        sequence that went elsewhere loses the kept cells."""
        left = []
        for c in chunks:
            q = self.ahead.get(c.seq_id)
            if q is None:
                left.append(c)
                continue
            a = q[0]
            if len(c.tokens) == 1 and (c.pos, int(c.tokens[0]), c.draw) == a[:3] and c.sampling is None:
                q.popleft()
                if not q:
                    del self.ahead[c.seq_id]
                res.tokens[c.seq_id] = a.sampled
                if a.logprobs is not None:
                    res.logprobs[c.seq_id] = a.logprobs
                res.served += 1
                continue
            self.host.trim_kv(c.seq_id, a.pos)
            left.append(c)
        return left

    def forget(self, seq_id: int, keep: int = 0) -> None:
        self.ahead.pop(seq_id, None)
        self.lookup.forget(seq_id, keep)
        if self._model_drafts is not None:
            self._model_drafts.forget(seq_id, keep)
        if keep <= 0:
            self._acceptance.pop(seq_id, None)
            self._guesses.pop(seq_id, None)
            self._yields.pop(seq_id, None)

    def close(self) -> None:
        if self._model_drafts is not None:
            self._model_drafts.close()
            self._model_drafts = None
