"""The node's budgets: what admission may hand out, fixed at start.

Defaults derive from the engine (the KV budget is what its context holds, the
active cap is its n_seq_max) so a node is sane with no flags; every override is
checked here once, so a budget that cannot work fails at start with a sentence
naming the setting instead of misbehaving under load.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from meshnode.core.costmodel import TILE_ROWS
from meshnode.core.types import ConfigError


def rows_problem(n_batch: int, n_ctx: int, n_seq_max: int, rows: int) -> str:
    """The one rule on a tick's size ("" when it holds): llama.cpp asserts on a batch or context smaller than
    its sequence slots, and a tick of `rows` decode rows needs room for a prompt token beside them (else a
    prompt would never start while every slot decodes)."""
    if min(n_batch, n_ctx) < n_seq_max or min(n_batch, n_ctx) <= rows:
        return (f"n_batch and ctx: must both be at least n_seq_max ({n_seq_max}) and exceed max_batch ({rows}): a "
                f"tick carries up to that many decode rows and needs room for a prompt token beside them; got "
                f"n_batch {n_batch}, ctx {n_ctx}")
    return ""


def deterministic_rows_problem(n_batch: int, rows: int) -> str:
    """Deterministic mode's rule on a tick's size ("" when it holds): a prompt chunk may take up to
    2 * TILE_ROWS - 1 rows (fill_deterministic) beside every decode row."""
    if n_batch < rows + 2 * TILE_ROWS - 1:
        return (f"deterministic: needs n_batch >= max_batch + {2 * TILE_ROWS - 1} (a prompt chunk may take up to "
                f"{2 * TILE_ROWS - 1} rows), got n_batch {n_batch}, max_batch {rows}")
    return ""


DEFAULT_MAX_QUEUE = 64  # sessions waiting for a slot (the `max_queue` setting's default, defined here once)


@dataclass(frozen=True)
class BudgetAsk:
    """What the node's settings ask of the budget (None: derive it from the engine's figures, which only
    exist once the model loaded); NodeBudget.from_engine(info, ask) is the budget."""

    max_active: int | None = None
    max_queue: int | None = None
    max_batch_size: int | None = None
    max_prefill_tokens_per_tick: int | None = None
    kv_budget_bytes: int | None = None
    weight_budget_bytes: int | None = None
    memory_floor_bytes: int | None = None
    fill_ticks: bool = False  # prefill unset and a tick target on: as many prompt tokens as a tick has room for

    def overrides(self, engine) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "fill_ticks"}
        if d["max_prefill_tokens_per_tick"] is None and self.fill_ticks:  # an upper bound: the target sizes ticks
            d["max_prefill_tokens_per_tick"] = engine.n_batch - (self.max_batch_size or engine.n_seq_max)
        return d


@dataclass(frozen=True)
class NodeBudget:
    weight_bytes: int  # what the loaded model occupies (reported)
    weight_budget_bytes: int  # a node whose weights exceed this refuses to start
    kv_budget_bytes: int
    kv_bytes_per_token: int
    scratch_per_session_bytes: int  # base working memory of one active session
    scratch_envelope_bytes: int  # all active sessions' scratch together
    max_queue: int
    max_active: int
    max_batch_size: int  # sequences per tick
    max_prefill_tokens_per_tick: int
    n_seq_max: int  # the engine's sequence slots
    n_ctx_seq: int  # the engine's per-sequence context
    n_batch: int  # the engine's most tokens per llama_decode
    memory_floor_bytes: int = 0  # reject new work while available memory is below this

    @classmethod
    def from_engine(cls, engine, ask: BudgetAsk = BudgetAsk(), **overrides) -> "NodeBudget":
        """Defaults from the engine's own figures; `ask` (the settings) and `overrides` set any field (None =
        default)."""
        overrides = {**ask.overrides(engine), **overrides}
        n_seq, n_ctx_seq = engine.n_seq_max, engine.n_ctx_seq
        weights = getattr(engine, "host_weight_bytes", engine.weight_bytes)  # an EngineInfo knows where they are
        base = 8 * engine.n_vocab  # one logits row plus sampling probabilities
        prefill = min(64, max(1, engine.n_batch - n_seq))
        b = cls(
            weight_bytes=weights, weight_budget_bytes=weights,
            kv_budget_bytes=engine.n_ctx * engine.kv_bytes_per_token,
            kv_bytes_per_token=engine.kv_bytes_per_token,
            scratch_per_session_bytes=base, scratch_envelope_bytes=n_seq * (base + 8 * n_ctx_seq),
            max_queue=DEFAULT_MAX_QUEUE, max_active=n_seq, max_batch_size=n_seq, max_prefill_tokens_per_tick=prefill,
            n_seq_max=n_seq, n_ctx_seq=n_ctx_seq, n_batch=engine.n_batch)
        b = replace(b, **{k: v for k, v in overrides.items() if v is not None})
        b.validate()
        return b

    def scratch_for(self, n_prompt: int, max_tokens: int) -> int:
        """A session's scratch: the base plus its token history, kept twice (front and arena)."""
        return self.scratch_per_session_bytes + 8 * (n_prompt + max_tokens)

    @property
    def effective_active_cap(self) -> int:
        return min(self.max_active, self.scratch_envelope_bytes // self.scratch_per_session_bytes,
                   self.n_seq_max)

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"{f.name} must be an integer, got {v!r}")
            lowest = 0 if f.name in ("memory_floor_bytes", "max_queue") else 1
            if v < lowest:
                raise ConfigError(f"{f.name} must be >= {lowest}, got {v}")
        if self.weight_bytes > self.weight_budget_bytes:
            raise ConfigError(f"model weights ({self.weight_bytes} bytes) exceed weight_budget_bytes "
                              f"({self.weight_budget_bytes}); the node refuses to start")
        if self.kv_budget_bytes < self.kv_bytes_per_token:
            raise ConfigError(f"kv_budget_bytes ({self.kv_budget_bytes}) is below one token "
                              f"({self.kv_bytes_per_token} bytes)")
        if self.scratch_envelope_bytes < self.scratch_per_session_bytes:
            raise ConfigError("scratch_envelope_bytes is below one session's scratch_per_session_bytes")
        if self.max_batch_size > self.n_seq_max:
            raise ConfigError(f"max_batch_size ({self.max_batch_size}) exceeds the engine's "
                              f"n_seq_max ({self.n_seq_max})")
        if self.max_batch_size + self.max_prefill_tokens_per_tick > self.n_batch:
            raise ConfigError(f"max_batch_size + max_prefill_tokens_per_tick "
                              f"({self.max_batch_size} + {self.max_prefill_tokens_per_tick}) exceeds "
                              f"the engine's n_batch ({self.n_batch})")

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["effective_active_cap"] = self.effective_active_cap
        return d
