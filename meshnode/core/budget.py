"""The node's budgets: what admission may hand out, fixed at start.

Defaults derive from the engine (the KV budget is what its context holds, the
active cap is its n_seq_max) so a node is sane with no flags; every override is
checked here once, so a budget that cannot work fails at start with a sentence
naming the setting instead of misbehaving under load.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace


class ConfigError(ValueError):
    """A budget or setting that cannot work; the message names it."""


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
    def from_engine(cls, engine, **overrides) -> "NodeBudget":
        """Defaults from the engine's own figures; `overrides` set any field (None = default)."""
        n_seq, n_ctx_seq = engine.n_seq_max, engine.n_ctx_seq
        weights = getattr(engine, "host_weight_bytes", engine.weight_bytes)  # an EngineInfo knows where they are
        base = 8 * engine.n_vocab  # one logits row plus sampling probabilities
        prefill = min(64, max(1, engine.n_batch - n_seq))
        b = cls(
            weight_bytes=weights, weight_budget_bytes=weights,
            kv_budget_bytes=engine.n_ctx * engine.kv_bytes_per_token,
            kv_bytes_per_token=engine.kv_bytes_per_token,
            scratch_per_session_bytes=base, scratch_envelope_bytes=n_seq * (base + 8 * n_ctx_seq),
            max_queue=64, max_active=n_seq, max_batch_size=n_seq, max_prefill_tokens_per_tick=prefill,
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
