"""Every `meshnode serve` setting, from defaults, a TOML file and CLI flags (in that order).

One dataclass is the single list of settings: the CLI flags, the config-file
keys and tools/meshnode.toml.example are all checked against it, so an
unknown key or a value of the wrong type is an error naming the key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from meshnode.budget import ConfigError


@dataclass
class NodeConfig:
    model: str | None = None  # GGUF path; None = generate and serve the tiny demo model
    listen: str | None = None  # client ROUTER endpoint; None = ipc:// in the run dir
    telemetry: str | None = None  # telemetry PUB endpoint; None = ipc:// in the run dir
    max_active: int | None = None  # sessions decoding at once (default: n_seq_max)
    max_queue: int = 64
    max_batch: int | None = None  # sequences per tick (default: n_seq_max)
    prefill_chunk: int | None = None  # prompt tokens per tick (default: 64)
    kv_budget_mb: float | None = None  # default: the whole KV pool
    weight_budget_mb: float | None = None  # default: whatever the model needs
    memory_floor_mb: float = 0.0  # reject new sessions below this much available memory
    ctx: int = 4096  # KV cells in the unified pool
    n_seq_max: int = 8  # llama.cpp sequence slots
    n_batch: int = 512
    threads: int = 0  # 0 = all cores
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"  # auto, on, off (off = f32 attention numerics)
    tick_deadline_s: float = 30.0  # an engine tick longer than this is a hung engine
    start_timeout_s: float = 300.0  # the first engine start (model load) may take this long
    restart_timeout_min_s: float = 10.0  # a restart may take max(this, 5 x the measured first start)
    pipeline_depth: int = 2  # ticks in flight: 2 plans the next tick while the engine runs one; 1 = lockstep
    drain_timeout_s: float = 30.0  # on SIGTERM, sessions get this long to finish
    metrics_listen: str | None = None  # host:port for Prometheus /metrics; None = off
    curve_secret_key: str | None = None
    curve_allow_dir: str | None = None
    insecure: bool = False
    log_level: str = "INFO"
    # test and drill knobs: not in the example file, not for production
    engine_kind: str = field(default="llama", metadata={"internal": True})
    faults: list | None = field(default=None, metadata={"internal": True})  # one per incarnation
    fake: dict | None = field(default=None, metadata={"internal": True})

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            want = _type_of(f)
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                setattr(self, f.name, float(v))
                continue
            if not isinstance(v, want) or (want is int and isinstance(v, bool)):
                raise ConfigError(f"{f.name}: expected {want.__name__}, got {v!r}")
        for name in ("max_active", "max_batch", "prefill_chunk", "ctx", "n_seq_max", "n_batch"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name}: must be >= 1, got {v}")
        for name in ("max_queue", "threads", "memory_floor_mb", "tick_deadline_s", "drain_timeout_s",
                     "start_timeout_s", "restart_timeout_min_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("kv_budget_mb", "weight_budget_mb"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name}: must be > 0, got {v}")
        if self.pipeline_depth not in (1, 2):
            raise ConfigError(f"pipeline_depth: must be 1 or 2, got {self.pipeline_depth}")
        if self.model is not None and not os.path.isfile(self.model):
            raise ConfigError(f"model: no such file {self.model}")
        if (self.curve_secret_key is None) != (self.curve_allow_dir is None):
            raise ConfigError("curve_secret_key and curve_allow_dir must be given together")
        from meshnode.engine.llama_engine import FLASH_ATTN, KV_TYPES

        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_TYPES:
                raise ConfigError(f"{name}: must be one of {sorted(KV_TYPES)}, got {getattr(self, name)!r}")
        if self.flash_attn not in FLASH_ATTN:
            raise ConfigError(f"flash_attn: must be one of {sorted(FLASH_ATTN)}, got {self.flash_attn!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.engine_kind not in ("llama", "fake"):
            raise ConfigError(f"engine_kind: unknown {self.engine_kind!r}")


def _type_of(f) -> type:
    t = f.type if isinstance(f.type, str) else f.type.__name__
    base = t.split("|")[0].strip()
    return {"str": str, "int": int, "float": float, "bool": bool, "dict": dict, "list": list}[base]


def public_keys() -> list[str]:
    return [f.name for f in fields(NodeConfig) if not f.metadata.get("internal")]


def load(path: str | None = None, overrides: dict | None = None) -> NodeConfig:
    """Defaults, then the TOML file, then non-None `overrides` (the CLI flags)."""
    values: dict = {}
    if path:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        known = set(public_keys())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) in {path}: {', '.join(unknown)}")
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    cfg = NodeConfig(**values)
    cfg.validate()
    return cfg
