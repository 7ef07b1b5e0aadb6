"""Every `meshnode serve` setting, from defaults, a TOML file, MESHNODE_<KEY> environment variables
and CLI flags (in that order: later wins, as llama-server's LLAMA_ARG_* do for its flags).

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

from meshnode.core.budget import DEFAULT_MAX_QUEUE, BudgetAsk, rows_problem
from meshnode.core.sizing import TickTarget
from meshnode.core.schedconfig import SchedulerConfig
from meshnode.core.prefix import SCOPES
from meshnode.core.priority import POLICIES, policy_problem
from meshnode.core.scheduler import GATHER_SPAN
from meshnode.core.speculation import MAX_DRAFTS, MODES as SPEC_MODES
from meshnode.core.types import POOLINGS, ConfigError
from meshnode.engine.config import EngineConfig
from meshnode.engine.llamacpp import FLASH_ATTN, KV_LAYOUTS, KV_TYPES, MAX_SEQ  # llama.cpp's own limits, defined once
from meshnode.ops import realmodel
from meshnode.ops.endpoint_rules import check_endpoints


def setting(default=None, help: str = "", *, range: tuple | None = None, choices: tuple | None = None,
            example=None, internal: bool = False, aliases: tuple = ()):
    """One setting: its default, the one line that documents it (the example file's comment and the
    flag's --help), the finite range a number must lie in or the values a string may take, and, for a
    default that is derived (None), an example value the example file shows commented out. `aliases`:
    other flags for it (llama-server's names, where it has the same setting)."""
    meta = {"help": help, "internal": internal, "example": example, "aliases": aliases}
    if range is not None:
        meta["range"] = range
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


def _in(lo: float, hi: float, default=None, internal: bool = False):
    """A numeric knob for tests and drills only (not in the example file, no flag)."""
    return setting(default, range=(lo, hi), internal=internal)


DAY = 86400.0
DEFAULT_LAYOUT = "streams"  # chosen by `meshnode bench burst` and `bench layout` (README, "KV layout")
EVICT_AFTER_S = 60.0  # at the connection cap, only a client silent this long gives way (front/gate.py says why)
DEFAULT_SEQS = 8  # sequence slots when neither n_seq_max nor max_active / max_batch asks for more
SESSION_CELLS = 4096  # with no ctx set, every session may reach this many tokens (fewer if the model's trained context is)


@dataclass
class NodeConfig:
    model: str | None = setting(None, "GGUF to serve, or a packaged model's name (smollm2, smollm2-q8_0, "
                                "smollm2-f16); unset = generate and serve the tiny demo model",
                                example="/var/lib/meshnode/models/model.gguf")
    listen: str | None = setting(None, "client ROUTER endpoint; unset = ipc://$RUNTIME_DIRECTORY/node.sock",
                                 example="tcp://127.0.0.1:5555")
    telemetry: str | None = setting(None, "telemetry PUB endpoint; unset = ipc://$RUNTIME_DIRECTORY/telemetry.sock",
                                    example="tcp://127.0.0.1:5556")
    max_active: int | None = setting(None, "sessions running at once; unset = n_seq_max", range=(1, MAX_SEQ), example=8)
    max_queue: int = setting(DEFAULT_MAX_QUEUE, "sessions waiting for a slot; beyond it submits get REJECTED_QUEUE_FULL",
                             range=(0, 1_000_000))
    max_batch: int | None = setting(None, "sequences per tick (decode rows in one llama_decode); unset = n_seq_max",
                                    range=(1, MAX_SEQ), example=8)
    prefill_chunk: int | None = setting(None, "most prompt tokens per tick; unset = n_batch - max_batch (64 with "
                                        "tick_target_ms = 0)", range=(1, 1 << 20), example=504)
    tick_target_ms: float | None = setting(None, "while sessions decode, prefill is sized by measured tick cost to "
                                           "keep ticks under this; unset = tick_target_ratio decode ticks; 0 = fixed "
                                           "chunks", range=(0, 60_000), example=420.0)
    tick_target_ratio: float = setting(8.0, "unless tick_target_ms is set: a tick with prompt rows may take this many "
                                       "times the decode-only tick of the sessions decoding", range=(1, 1000))
    kv_budget_mb: float | None = setting(None, "KV bytes admission may reserve; unset = the whole KV pool",
                                         range=(1e-3, 1e9), example=32.0)
    weight_budget_mb: float | None = setting(None, "refuse to start when the model's weights are larger; unset = no "
                                             "limit", range=(1e-3, 1e9), example=4096.0)
    memory_floor_mb: float = setting(0.0, "reject new sessions while available (cgroup) memory is below this",
                                     range=(0, 1e9))
    ctx: int | None = setting(None, "KV cells in all (streams: ctx / n_seq_max each); unset = 4096 a session "
                              "(x n_seq_max on streams)", range=(1, 1 << 26), example=32768)
    n_seq_max: int | None = setting(None, "llama.cpp sequence slots (most sessions that can run at once); unset = "
                                    "8, or max_active / max_batch where larger", range=(1, MAX_SEQ), example=8)
    n_batch: int = setting(512, "most tokens one llama_decode may carry (> max_batch)", range=(1, 1 << 20))
    threads: int = setting(0, "CPU threads for llama.cpp; 0 = all cores", range=(0, 4096))
    type_k: str = setting("f16", "KV cache type for K", choices=tuple(KV_TYPES), aliases=("--cache-type-k", "-ctk"))
    type_v: str = setting("f16", "KV cache type for V (a quantized one needs flash attention)", choices=tuple(KV_TYPES),
                          aliases=("--cache-type-v", "-ctv"))
    flash_attn: str = setting("auto", "llama.cpp flash attention: auto, on, off (off = f32 attention numerics)",
                              choices=tuple(FLASH_ATTN))
    kv_layout: str | None = setting(None, "streams: ctx / n_seq_max cells per sequence; unified: one KV pool for "
                                    "all; unset = streams", choices=KV_LAYOUTS, example="streams")
    deterministic: bool | None = setting(None, "a session's tokens bitwise the same whatever shares its ticks "
                                         "(docs/determinism.md): true = required (refused where it cannot hold), "
                                         "false = off, unset = on wherever it holds", example=True)
    rpc: str | None = setting(None, "ggml RPC workers (`meshnode rpc-worker`) to spread the model's layers over: "
                              "HOST:PORT,..; unset = none", example="10.0.0.2:50052,10.0.0.3:50052")
    gpu_layers: int | None = setting(None, "layers on the offload devices (rpc workers, a GPU build's GPUs), the "
                                     "rest on this CPU; unset = all", range=(0, 1 << 20), example=99)
    tensor_split: str | None = setting(None, "the offload devices' shares of those layers, in their order (rpc "
                                       "workers first); unset = by free memory", example="1,1")
    device: str | None = setting(None, "offload devices by llama.cpp's names (RPC0, CUDA0, ..), or none; unset = "
                                 "all", example="RPC0,RPC1")
    spec: str = setting("auto", "speculative decoding (docs/speculative.md): auto = drafts where the cost model "
                        "expects them to pay (none on a busy node; prompt lookup, else the draft model), lookup = the "
                        "most drafts a lookup finds, draft = the draft model's always, off; never changes a token "
                        "in deterministic mode", choices=SPEC_MODES)
    draft_model: str | None = setting(None, "a GGUF with the model's tokenizer that drafts tokens (llama-server's "
                                      "-md), or a packaged model's name; unset = prompt lookup only",
                                      aliases=("-md",), example="smollm2")
    draft_max: int = setting(16, "most draft tokens a session carries a tick (llama-server's --spec-draft-n-max)",
                             range=(0, MAX_DRAFTS))
    draft_min: int = setting(0, "fewest draft tokens worth a drafted tick (llama-server's --spec-draft-n-min)",
                             range=(0, MAX_DRAFTS))
    scheduling_policy: str = setting("fcfs", "the queue's order: fcfs (arrival), priority (a submit's priority, "
                                     "lower first, arrival within one; a better one takes a full queue's worst "
                                     "place, which ends REJECTED_QUEUE_FULL, and preempts worse running ones)",
                                     choices=POLICIES)
    priority_reserved_slots: int = setting(0, "with scheduling_policy = priority: sequence slots only a request "
                                           "of a priority below 0 may take, so one starts at once while the "
                                           "others are full (without preempting anyone)", range=(0, MAX_SEQ))
    kv_events: str | None = setting(None, "publish the prefix cache's blocks as KV events (vLLM's BlockStored, "
                                    "BlockRemoved, AllBlocksCleared) on this ZeroMQ PUB endpoint, for prefix-aware "
                                    "routers (docs/operating.md); unset = off", example="tcp://127.0.0.1:5557")
    chat_special_in_content: bool = setting(False, "text like </s> or <|im_start|> in chat content becomes that "
                                            "special token (llama-server's way: a client can inject turns; trusted "
                                            "clients only)")
    prefix_cache: str = setting("client", "reuse finished sessions' KV for prompts that start the same: client "
                                "(same client identity only), node (anyone: a hit is a timing signal), off",
                                choices=SCOPES)
    kv_persist: str | None = setting(None, "a folder the prefix cache's entries are written to at drain and read back "
                                     "at start, so conversations outlive a restart (each file checked by SHA-256, "
                                     "recipe and tokens); unset = off", example="/var/lib/meshnode/kv")
    mesh_key_file: str | None = setting(None, "a secret (32 bytes or more, mode 0600) shared by the nodes of one mesh: "
                                        "exports sign their KV with it, and an import's KV is loaded only with a "
                                        "valid signature (otherwise it is prefilled from its tokens); unset = any "
                                        "KV that passes the node's full check is loaded",
                                        example="/etc/meshnode/mesh.key")
    kv_persist_mb: float = setting(1024.0, "the most KV kv_persist writes at drain, the most recently used entries "
                                   "first", range=(1e-3, 1e9))
    rpc_timeout_s: float = setting(2.0, "each rpc worker must answer ggml's hello within this long, at start and "
                                   "before an engine restart, or the node names it (exit 1 at start)",
                                   range=(0.1, 600))
    tick_deadline_s: float = setting(30.0, "an engine tick running longer is a hung engine: killed and restarted",
                                     range=(0.5, DAY))
    start_timeout_s: float = setting(300.0, "the first engine start (loading the model) may take this long",
                                     range=(1.0, DAY))
    restart_timeout_min_s: float = setting(10.0, "a restarted engine must say hello within max(this, 5 x the first "
                                           "start)", range=(0.5, DAY))
    pipeline_depth: int = setting(2, "ticks in flight: 2 plans the next tick while the engine runs one; 1 = lockstep",
                                  range=(1, 2))
    decode_steps_ms: float = setting(50.0, "where every session decodes and no prompt is prefilled, a tick runs the decode "
                                     "rows again for up to this long, or a tenth longer (fewer plans, answers and "
                                     "client messages a token: core/steps.py); 0 = one step a tick", range=(0, 1000))
    gather_ms: float = setting(1.0, "on an idle engine, the first tick waits until no request has come for this "
                               f"long (at most {GATHER_SPAN}x): requests sent together start together; 0 = at once",
                               range=(0, 100))
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long running and queued sessions get to finish",
                                     range=(0, DAY))
    handoff: str | None = setting(None, "at a drain, move the live sessions with their KV to this peer node (its "
                                  "client endpoint, same recipe) and relay their streams until they end there; "
                                  "unset = they get drain_timeout_s, then DRAINED", example="tcp://10.0.0.3:5555")
    max_clients: int = setting(1024, "client connections at once; at the cap a new one takes the place of the "
                               "longest-idle one with no session, and is refused only when all are busy",
                               range=(1, 1_000_000))
    client_idle_timeout_s: float = setting(300.0, "a client connection with no session and no request for this long "
                                           "is closed (0 = never); its ZeroMQ socket reconnects when it next sends",
                                           range=(0, DAY))
    max_clients_per_host: int = setting(256, "connections from one remote tcp:// address (0 = no cap; loopback and "
                                        "ipc:// are exempt)", range=(0, 1_000_000))
    metrics_listen: str | None = setting(None, "serve Prometheus /metrics on HOST:PORT; unset = off",
                                         example="127.0.0.1:9108")
    http: str | None = setting(None, "serve the OpenAI HTTP API on HOST:PORT, or HOST,HOST:PORT for several addresses "
                               "(`meshnode gateway` as a supervised child); "
                               "unset = off", example="127.0.0.1:8080")
    pooling: str = setting("mean", "how an embedding's rows pool (llama-server's --pooling): mean, cls (the first "
                           "token), last; none: no default pooling, so `embed: true` and /v1/embeddings are refused "
                           "(llama-server's OpenAI endpoint under --pooling none)", choices=(*POOLINGS, "none"))
    http_sampling_defaults: str | None = setting(None, "sampling options an HTTP request leaves out, a JSON object "
                                                 "of OpenAI's names (llama-server's --temp, --seed; vLLM's generation "
                                                 "config); unset = OpenAI's temperature 1 and a random seed",
                                                 example='{"temperature": 0.8, "seed": 42}')
    http_cors_origins: str | None = setting(None, "web origins beside this host's whose pages may call the HTTP API "
                                            "(CORS), comma-separated, or * for any; unset = this host's only",
                                            example="https://chat.example.com")
    served_model_name: str | None = setting(None, "the model's name in the HTTP API and the metrics' model_name "
                                            "label (vLLM's --served-model-name, llama-server's --alias); several, "
                                            "comma-separated: the first in alphabetical order is its id, all are its "
                                            "aliases in /v1/models; unset = the GGUF's file name",
                                            example="smollm2-135m-instruct")
    served_model_tags: str | None = setting(None, "tags /v1/models lists for the model, comma-separated "
                                            "(llama-server's --tags)", example="chat,small")
    reasoning_format: str = setting("auto", "a reasoning model's <think> thought in the HTTP API's answers: auto "
                                    "(or deepseek, the same) parses it into reasoning_content, thinking blocks and "
                                    "reasoning items; none leaves it in the text (llama-server's --reasoning-format)",
                                    choices=("none", "auto", "deepseek"))
    http_metrics: bool = setting(True, "the HTTP API serves the node's Prometheus text at /metrics; off = 501 "
                                 "there, as llama-server without --metrics (--metrics-listen is apart)")
    http_api_key_file: str | None = setting(None, "API keys the HTTP API accepts, one per line (Authorization: Bearer); "
                                            "needed for an address others can reach, unless insecure",
                                            example="/etc/meshnode/api-keys")
    curve_secret_key: str | None = setting(None, "CURVE server certificate (zmq.auth format)",
                                           example="/etc/meshnode/server.key_secret")
    curve_allow_dir: str | None = setting(None, "directory of allowed client public keys (*.key)",
                                          example="/etc/meshnode/clients")
    insecure: bool = setting(False, "allow an endpoint others can reach without CURVE")
    log_level: str = setting("INFO", "DEBUG also shows llama.cpp's own log", choices=("DEBUG", "INFO", "WARNING",
                                                                                        "ERROR"))
    # test and drill knobs: not in the example file, no flag, not for production
    # "module:callable" the engine process builds its engine with, called (EngineConfig, engine_args,
    # incarnation); "" = llama.cpp's (LlamaEngine). Tests name meshnode/dev/engines.py's: a fake, faults.
    engine_factory: str = setting("", internal=True)
    engine_args: dict | None = setting(None, internal=True)
    evict_after_s: float = _in(0, DAY, EVICT_AFTER_S, internal=True)  # at the cap, silence that makes a connection give way

    def __post_init__(self) -> None:
        """n_seq_max unset follows max_active / max_batch: `--max-active 64` alone is enough to run 64 sessions
        (bad types are validate()'s to name: only numbers count here)."""
        asked = [v for v in (self.max_active, self.max_batch) if isinstance(v, int)]
        if self.n_seq_max is None:
            self.n_seq_max = max([DEFAULT_SEQS, *asked])

    def validate(self) -> None:
        """Each value against its declaration, the files and endpoints it names, then the rules between
        values (resolve): a start that cannot work fails here, in one line naming the setting."""
        self._check_values()
        self._find_models()
        check_endpoints(self)
        self.resolve()

    def _check_values(self) -> None:
        if isinstance(self.log_level, str):
            self.log_level = self.log_level.upper()
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
            if "choices" in f.metadata and v not in f.metadata["choices"]:
                raise ConfigError(f"{f.name}: must be one of {', '.join(f.metadata['choices'])}, got {v!r}")

    def _find_models(self) -> None:
        """A packaged model's name becomes its path; a path must exist."""
        for key in ("model", "draft_model"):
            path = getattr(self, key)
            if path in realmodel.NAMES:  # a real model a package ships, by name (meshnode/ops/realmodel.py)
                try:
                    setattr(self, key, path := str(realmodel.real_model(path)))
                except (LookupError, RuntimeError) as e:
                    raise ConfigError(f"{key}: {e}") from None
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{key}: no such file {path}")

    @property
    def layout(self) -> str:
        """The KV layout in effect: as set, else DEFAULT_LAYOUT (the one deterministic mode needs)."""
        return self.kv_layout or DEFAULT_LAYOUT

    @property
    def n_ctx(self) -> int:
        """KV cells in all: as set, else enough that any session may reach SESSION_CELLS tokens (on
        streams that is SESSION_CELLS per sequence slot; the engine trims what the model could not use)."""
        if self.ctx:
            return self.ctx
        return SESSION_CELLS * (self.n_seq_max if self.layout == "streams" else 1)

    def resolve(self) -> "Resolved":
        """Every value derived from the settings, once, and every rule between them checked before the model
        loads: what the engine runs (its EngineConfig has no defaults of its own), what the budget is asked,
        the tick target. The node, the benchmarks and the tests all build their engines here."""
        for key in ("max_active", "max_batch"):
            if (getattr(self, key) or 0) > self.n_seq_max:
                raise ConfigError(f"{key}: {getattr(self, key)} is more than n_seq_max ({self.n_seq_max}) sequence "
                                  f"slots; raise n_seq_max or leave it unset (it follows {key})")
        rows = self.max_batch or self.n_seq_max  # decode rows a tick may carry
        listed = lambda v: tuple(x.strip() for x in (v or "").split(",") if x.strip())  # noqa: E731
        engine = EngineConfig(self.model or "", n_seq_max=self.n_seq_max, n_ctx=self.n_ctx, n_batch=self.n_batch,
                              max_rows=rows, n_threads=self.threads, type_k=self.type_k, type_v=self.type_v,
                              flash_attn=self.flash_attn, kv_layout=self.layout, deterministic=self.deterministic,
                              rpc=listed(self.rpc), gpu_layers=self.gpu_layers,
                              tensor_split=tuple(_share(x) for x in listed(self.tensor_split)),
                              devices=listed(self.device), spec=self.spec, draft_model=self.draft_model or "",
                              draft_max=self.draft_max, draft_min=self.draft_min,
                              hurry=self.scheduling_policy == "priority")
        why = rows_problem(self.n_batch, self.n_ctx, self.n_seq_max, rows) or policy_problem(
            self.scheduling_policy, self.priority_reserved_slots, self.max_active or self.n_seq_max)
        if why:
            raise ConfigError(why)
        if not self.engine_factory:
            try:  # what llama.cpp would refuse or assert on, or cannot promise, refused here first
                engine.validate(need_file=False)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        scheduler = self.scheduler()
        mb = lambda v: None if v is None else int(v * 2**20)  # noqa: E731
        budget = BudgetAsk(self.max_active, self.max_queue, self.max_batch, self.prefill_chunk, mb(self.kv_budget_mb),
                           mb(self.weight_budget_mb), mb(self.memory_floor_mb), fill_ticks=bool(scheduler.tick_target))
        return Resolved(engine, budget, scheduler)

    def scheduler(self) -> SchedulerConfig:
        """The scheduler's part of resolve(), which needs no model."""
        target = TickTarget(self.tick_target_ms or 0.0, self.tick_target_ratio if self.tick_target_ms is None else 0.0,
                            self.decode_steps_ms)
        return SchedulerConfig(self.prefix_cache, target, self.gather_ms, bool(self.kv_events), self.scheduling_policy,
                               self.priority_reserved_slots, self.decode_steps_ms)


@dataclass(frozen=True)
class Resolved:
    """The settings' typed parts, derived once; the serving settings (endpoints, timeouts) are NodeConfig's own."""

    engine: EngineConfig
    budget: BudgetAsk
    scheduler: SchedulerConfig


def engine_config(model: str, **settings) -> EngineConfig:
    """The engine `meshnode serve --model MODEL` with these settings (NodeConfig's names) would run: how
    benchmarks and tests build an engine in-process, with the node's defaults and checks."""
    return load(overrides={"model": model, **settings}).resolve().engine


def scheduler_config(**settings) -> SchedulerConfig:
    """The scheduler policy `meshnode serve` with these settings (NodeConfig's names) would run: how
    benchmarks and tests build a scheduler, with the node's defaults and checks."""
    return NodeConfig(**settings).scheduler()


def _share(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        raise ConfigError(f"tensor_split: {x!r} is not a number (write shares like 3,1)") from None


def _type_of(f) -> type:
    t = f.type if isinstance(f.type, str) else f.type.__name__
    base = t.split("|")[0].strip()
    return {"str": str, "int": int, "float": float, "bool": bool, "dict": dict, "list": list}[base]


def _public():
    return [f for f in fields(NodeConfig) if not f.metadata.get("internal")]


def public_keys() -> list[str]:
    return [f.name for f in _public()]


ENV_PREFIX = "MESHNODE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def from_environment(environ) -> dict:
    """The settings given as MESHNODE_<KEY> variables (a container's or a unit's `Environment=`), typed
    like the flags. Other MESHNODE_ variables (MESHNODE_RUN_DIR, MESHNODE_CACHE) are not settings and are
    left alone; a value that does not parse is an error naming the variable."""
    values = {}
    for f in _public():
        name = ENV_PREFIX + f.name.upper()
        if name not in environ:
            continue
        raw, want = environ[name].strip(), _type_of(f)
        try:
            if want is bool:
                if raw.lower() not in _TRUE + _FALSE:
                    raise ValueError(f"not one of {'/'.join(_TRUE + _FALSE)}")
                values[f.name] = raw.lower() in _TRUE
            else:
                values[f.name] = want(raw)
        except ValueError as e:
            raise ConfigError(f"{name}={environ[name]!r} is not a valid {f.name}: {e}") from None
    return values


def load(path: str | None = None, overrides: dict | None = None, environ=None) -> NodeConfig:
    """Defaults, then the TOML file, then MESHNODE_<KEY> variables of `environ` (default: none), then
    non-None `overrides` (the CLI flags)."""
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
    values.update(from_environment(environ or {}))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    cfg = NodeConfig(**values)
    cfg.validate()
    return cfg
