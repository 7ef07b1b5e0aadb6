"""Every `meshnode serve` setting, from defaults, a TOML file and CLI flags (in that order).

One dataclass is the single list of settings: the CLI flags, the config-file
keys and tools/meshnode.toml.example are all checked against it, so an
unknown key or a value of the wrong type is an error naming the key.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from meshnode.core.budget import ConfigError
from meshnode.core.prefix import SCOPES


def _in(lo: float, hi: float, default=None, internal: bool = False):
    """A numeric setting and the finite range it must lie in (checked at start, exit 2)."""
    return field(default=default, metadata={"range": (lo, hi), "internal": internal})


DAY = 86400.0
DEFAULT_LAYOUT = "streams"  # chosen by `meshnode bench burst` and `bench layout` (README, "KV layout")
SESSION_CELLS = 4096  # with no ctx set, every session may reach this many tokens (fewer if the model's trained context is)


@dataclass
class NodeConfig:
    model: str | None = None  # GGUF path; None = generate and serve the tiny demo model
    listen: str | None = None  # client ROUTER endpoint; None = ipc:// in the run dir
    telemetry: str | None = None  # telemetry PUB endpoint; None = ipc:// in the run dir
    max_active: int | None = _in(1, 256)  # sessions decoding at once (default: n_seq_max)
    max_queue: int = _in(0, 1_000_000, 64)
    max_batch: int | None = _in(1, 256)  # sequences per tick (default: n_seq_max)
    prefill_chunk: int | None = _in(1, 1 << 20)  # most prompt tokens per tick (default: n_batch - max_batch; 64 without a tick target)
    tick_target_ms: float = _in(0, 60_000, 420.0)  # while sessions decode, size prefill to keep ticks this short (0 = fixed chunks)
    kv_budget_mb: float | None = _in(1e-3, 1e9)  # default: the whole KV pool
    weight_budget_mb: float | None = _in(1e-3, 1e9)  # default: whatever the model needs
    memory_floor_mb: float = _in(0, 1e9, 0.0)  # reject new sessions below this much available memory
    ctx: int | None = _in(1, 1 << 26)  # KV cells in all (streams: ctx / n_seq_max each); default: SESSION_CELLS a session
    n_seq_max: int = _in(1, 256, 8)  # llama.cpp sequence slots
    n_batch: int = _in(1, 1 << 20, 512)
    threads: int = _in(0, 4096, 0)  # 0 = all cores
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"  # auto, on, off (off = f32 attention numerics)
    kv_layout: str | None = None  # unified: one KV pool; streams: ctx / n_seq_max cells per sequence (default below)
    deterministic: bool = False  # a session's tokens the same whatever shares its ticks (docs/determinism.md)
    chat_special_in_content: bool = False  # chat content may spell special tokens (llama-server's way; trusted clients only)
    prefix_cache: str = "client"  # reuse finished sessions' KV: client (same client only), node (anyone), off
    tick_deadline_s: float = _in(0.5, DAY, 30.0)  # an engine tick longer than this is a hung engine
    start_timeout_s: float = _in(1.0, DAY, 300.0)  # the first engine start (model load) may take this long
    restart_timeout_min_s: float = _in(0.5, DAY, 10.0)  # a restart may take max(this, 5 x the first start)
    pipeline_depth: int = _in(1, 2, 2)  # ticks in flight: 2 plans the next tick while the engine runs one
    drain_timeout_s: float = _in(0, DAY, 30.0)  # on SIGTERM, sessions get this long to finish
    max_clients: int = _in(1, 1_000_000, 1024)  # client connections; at the cap a new one replaces the idlest idle one
    client_idle_timeout_s: float = _in(0, DAY, 300.0)  # a connection with no session silent this long is closed (0 = never)
    max_clients_per_host: int = _in(0, 1_000_000, 256)  # connections from one remote tcp address (0 = no cap; loopback exempt)
    metrics_listen: str | None = None  # host:port for Prometheus /metrics; None = off
    curve_secret_key: str | None = None
    curve_allow_dir: str | None = None
    insecure: bool = False
    log_level: str = "INFO"
    # test and drill knobs: not in the example file, not for production
    engine_kind: str = field(default="llama", metadata={"internal": True})
    faults: list | None = field(default=None, metadata={"internal": True})  # one per incarnation
    engine_wrapper: str = field(default="", metadata={"internal": True})  # "module:callable" that injects them
    fake: dict | None = field(default=None, metadata={"internal": True})
    evict_after_s: float = _in(0, DAY, 10.0, internal=True)  # at the cap, silence that makes a connection give way

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            want = _type_of(f)
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
                setattr(self, f.name, v)
            if not isinstance(v, want) or (want is int and isinstance(v, bool)):
                raise ConfigError(f"{f.name}: expected {want.__name__}, got {v!r}")
            if "range" in f.metadata:
                lo, hi = f.metadata["range"]
                if not (math.isfinite(v) and lo <= v <= hi):  # nan and inf fail here too
                    raise ConfigError(f"{f.name}: must be between {lo:g} and {hi:g}, got {v!r}")
        if self.model is not None and not os.path.isfile(self.model):
            raise ConfigError(f"model: no such file {self.model}")
        if (self.curve_secret_key is None) != (self.curve_allow_dir is None):
            raise ConfigError("curve_secret_key and curve_allow_dir must be given together")
        if self.curve_secret_key is not None and not os.path.isfile(self.curve_secret_key):
            raise ConfigError(f"curve_secret_key: no such file {self.curve_secret_key}")
        if self.curve_allow_dir is not None and not os.path.isdir(self.curve_allow_dir):
            raise ConfigError(f"curve_allow_dir: no such directory {self.curve_allow_dir}")
        if self.metrics_listen is not None:
            host, _, port = self.metrics_listen.rpartition(":")
            if not (host and port.isdigit() and 1 <= int(port) <= 65535):
                raise ConfigError(f"metrics_listen: must be HOST:PORT with a port in [1, 65535], "
                                  f"got {self.metrics_listen!r}")
        from ipc.transport import EndpointError, check_private

        for key, ep, what in (("listen", self.listen, "client"), ("telemetry", self.telemetry, "telemetry"),
                              ("metrics_listen", self.metrics_listen and f"tcp://{self.metrics_listen}", "metrics")):
            try:  # the rule the sockets enforce when they bind, applied before anything starts
                if ep:
                    check_private(ep, what, self.curve_secret_key is not None and what != "metrics", self.insecure)
            except EndpointError as e:
                raise ConfigError(f"{key}: {e}") from None
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.prefix_cache not in SCOPES:
            raise ConfigError(f"prefix_cache: must be one of {', '.join(SCOPES)}, got {self.prefix_cache!r}")
        if self.engine_kind not in ("llama", "fake"):
            raise ConfigError(f"engine_kind: unknown {self.engine_kind!r}")
        rows = self.max_batch or self.n_seq_max  # decode rows a tick may carry; llama.cpp caps n_batch at ctx
        if min(self.n_batch, self.ctx or self.n_batch) <= rows:
            raise ConfigError(f"n_batch and ctx: must both exceed max_batch ({rows}): a tick carries up to that "
                              f"many decode rows and needs room for a prompt token beside them; got n_batch "
                              f"{self.n_batch}, ctx {self.ctx}")
        if self.engine_kind == "llama":
            try:  # what llama.cpp would refuse or assert on, or cannot promise, refused here first
                self.engine_config(self.model or "").validate(need_file=False)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    @property
    def layout(self) -> str:
        """The KV layout in effect: as set, else streams for deterministic mode (it needs them), else DEFAULT_LAYOUT."""
        return self.kv_layout or ("streams" if self.deterministic else DEFAULT_LAYOUT)

    @property
    def n_ctx(self) -> int:
        """KV cells in all: as set, else enough that any session may reach SESSION_CELLS tokens (on
        streams that is SESSION_CELLS per sequence slot; the engine trims what the model could not use)."""
        if self.ctx:
            return self.ctx
        return SESSION_CELLS * (self.n_seq_max if self.layout == "streams" else 1)

    def engine_config(self, model_path: str):
        from meshnode.engine.llama import EngineConfig

        return EngineConfig(model_path, n_seq_max=self.n_seq_max, n_ctx=self.n_ctx, n_batch=self.n_batch,
                            n_threads=self.threads, type_k=self.type_k, type_v=self.type_v,
                            flash_attn=self.flash_attn, kv_layout=self.layout, deterministic=self.deterministic)


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
