"""A generation session: the request, and how far it has got."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from meshnode.core import reasons as R
from meshnode.core.types import GREEDY, Constrained, Grammar, Logprob, Sampling, SeqChunk

NEW, QUEUED, RUNNING, DONE = "NEW", "QUEUED", "RUNNING", "DONE"


@dataclass(frozen=True)
class Ask:
    """What admission weighs: a request's sizes, never its tokens (a text's can be a bound)."""
    key: Hashable
    n_prompt: int
    max_tokens: int
    recipe: str | None = None
    priority: int = 0  # lower is served earlier (vLLM's meaning), under the priority policy

    @property
    def kv_tokens(self) -> int:
        """KV cells reserved for the whole session, so it never runs out mid-generation."""
        return self.n_prompt + self.max_tokens


@dataclass(eq=False)
class Session:
    key: Hashable  # unique among live sessions; the front uses (client identity, id)
    prompt: list[int]
    max_tokens: int
    sampling: Sampling = GREEDY
    stop_tokens: frozenset = frozenset()
    ignore_eos: bool = False
    recipe: str | None = None
    owner: Hashable = None  # whose cached KV it may reuse (the client identity; meshnode/core/prefix.py)
    grammar: Grammar | None = None  # compiled response_format (meshnode/text/constraints.py)
    priority: int = 0  # lower is served earlier, under the priority policy (Scheduler)
    stop_text: bool = False  # the front watches its text for stop strings, a token at a time
    embed: str = ""  # an embedding session (its prompt's pooled vector, how pooled: engine/embeddings.py)
    progress: bool = False  # its client asked `progress` events as its prompt is computed
    order: tuple = (0, 0)  # where it stands in the queue: (priority under that policy, else 0; arrival)
    # progress: `tokens` is prompt + generated. tokens[:n_planned] are in the KV or in a tick on
    # its way there; `draws_in_flight` samples are asked for and not back yet (pipelined ticks)
    tokens: list[int] = field(default_factory=list)
    n_planned: int = 0
    n_reused: int = 0  # prompt tokens whose KV came from the prefix cache
    leader: tuple | None = None  # (session, n): copy its first n tokens' KV once it has computed them
    draws_in_flight: int = 0
    seq_id: int = -1
    state: str = NEW
    reason: str | None = None
    last_tick: int = -1
    stale_before: int = 0  # ticks planned before this plan count are not this incarnation's (preempted since)
    # moving between nodes (core/moves.py): where its KV is saved to, once asked to leave; whether a planned
    # tick saves it; the KV it arrived with ((path, positions), until it starts)
    export_to: str = ""
    saving: bool = False
    kv_import: tuple | None = None
    t_submit: float = 0.0
    t_start: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    def __post_init__(self):
        self.prompt = list(self.prompt)
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def pending(self) -> int:
        """Tokens still to feed before the next sample: 1 when decoding, more in prefill.

        A sample in flight counts as a token to feed (the engine fills it in), unless it is the
        session's last one: feeding it would compute a token nobody asked for.
        """
        if self.draws_in_flight and self.n_generated + self.draws_in_flight >= self.max_tokens:
            return 0
        return len(self.tokens) + self.draws_in_flight - self.n_planned

    def next_chunk(self, n: int, tick: int) -> SeqChunk:
        """Its next `n` tokens to feed, as a chunk of tick number `tick`, planned: a chunk that reaches the end
        of its tokens (and samples in flight) samples the next one; a token still in flight is a `follow` the
        engine fills in. Sampling and the output constraint ride on its first chunk after reused KV."""
        self.last_tick = tick
        start, known = self.n_planned, self.tokens[self.n_planned:self.n_planned + n]
        end = start + n == len(self.tokens) + self.draws_in_flight
        first = start == self.n_reused
        chunk = SeqChunk(self.seq_id, start, np.asarray(known + [-1] * (n - len(known)), dtype=np.int32),
                         draw=self.n_generated + self.draws_in_flight if end else -1,
                         sampling=self.sampling if first else None, follow=len(known) < n,
                         constraint=Constrained(self.grammar, len(self.prompt)) if self.grammar and first else None,
                         embed=self.embed)
        self.n_planned += n
        self.draws_in_flight += end
        return chunk

    def finish_reason(self, tok: int, eog) -> str | None:
        """Why the session ends on the token it just took, or None (`eog`: the model's end-of-generation ids)."""
        if tok in eog and not self.ignore_eos:
            return R.EOS
        if tok in self.stop_tokens:
            return R.STOP
        if self.n_generated >= self.max_tokens:
            return R.LENGTH
        return None

    def end_tokens(self, eog: frozenset) -> frozenset:
        """The tokens that end it whenever they come (finish_reason's), for a multi-step tick's row (Plan.ends)."""
        return self.stop_tokens if self.ignore_eos else eog | self.stop_tokens

    def forget_kv(self) -> None:
        """Its KV is gone (an engine restart, a preemption): everything is fed again from position 0."""
        self.n_planned = self.n_reused = self.draws_in_flight = 0

    @property
    def ask(self) -> Ask:
        return Ask(self.key, len(self.prompt), self.max_tokens, self.recipe, self.priority)

    def usage(self) -> dict:
        ms = lambda a, b: round(max(0.0, (a - b) * 1e3), 3) if a else 0.0  # noqa: E731
        return {"prompt_tokens": len(self.prompt), "completion_tokens": self.n_generated,
                "cached_tokens": self.n_reused,
                "queue_ms": ms(self.t_start, self.t_submit), "ttft_ms": ms(self.t_first, self.t_submit),
                "total_ms": ms(self.t_done, self.t_submit)}


@dataclass
class Event:
    """What a tick (or an end) meant for one session, for the output stage to send."""
    kind: str  # "tokens", "embedding", "progress", "exported" or "done"
    session: Session
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    detail: str = ""  # why, in a sentence, when the reason alone does not say (a `done` only)
    logprobs: list[Logprob] | None = None  # per token, when the session asked
    embedding: list[float] | None = None  # an `embedding` event's vector
    kv: tuple | None = None  # an `exported` event's saved KV: (path, positions, bytes), None when it has none
    progress: tuple | None = None  # a `progress` event's (total, cache, processed): prompt tokens
