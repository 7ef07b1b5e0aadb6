"""The types every layer shares: a tick's plan, an engine's result and shape, engine and config errors.

This is the leaf of the package graph: policy, engines and the wire all speak
these, so none of them has to import another to agree on what a tick is.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple, Union

import numpy as np


class ConfigError(ValueError):
    """A setting or budget that cannot work; the message names it (a start refused with exit 2)."""


class EngineError(Exception):
    """Base of engine failures; `fatal` ones mean the context can no longer be trusted."""

    fatal = False


class InvalidPlan(EngineError):
    """The plan broke the contract (bad token, position, sequence id, size)."""


class ConstraintFailed(ValueError):
    """A session's response_format cannot go on (the constraint library's limits, or no token may come next):
    that session ends with BAD_REQUEST, never the tick it was in. The message is the library's own first line:
    llguidance appends its parser state and the whole grammar, which no client should get back."""

    def __init__(self, words: str):
        super().__init__(library_words(words))


def library_words(raw: str, limit: int = 300) -> str:
    """The first line of a constraint library's error, without the state dump that follows it."""
    line = raw.split("<state>", 1)[0].strip().splitlines()
    return (line[0] if line else raw)[:limit]


class FatalEngineError(EngineError):
    """llama_decode returned < -1, or the engine is otherwise unusable: restart it."""

    fatal = True


FORMATS = ("json_schema", "json_object", "regex", "grammar", "lark")  # response_format types (docs/protocol.md)
POOLINGS = ("mean", "cls", "last")  # how an embedding session's rows pool (meshnode/engine/embeddings.py)


@dataclass(frozen=True)
class ResponseFormat:
    """What a session's output must match: `kind` one of FORMATS; `spec` the schema as JSON text, the regex, the
    GBNF grammar or an llguidance Lark grammar ("" for json_object). Checked by the constraint library before
    admission."""

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class Grammar:
    """A compiled response_format (llguidance's grammar text) under a key derived from the text: the text
    crosses the engine link once per engine incarnation (ipc/link.py, GrammarText) and ticks name it by key."""

    key: str
    text: str = field(repr=False)


@dataclass(frozen=True)
class Constrained:
    """A session's output grammar, riding on its sequence's first chunk like its sampling; the engine
    feeds it every token generated past `n_prompt` (meshnode/engine/constraint.py)."""

    grammar: Grammar
    n_prompt: int


@dataclass(frozen=True)
class Sampling:
    """How a session's tokens are picked (meshnode/engine/sampling.py; ranges in docs/protocol.md)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # llama.cpp's: 1 = off
    repeat_last_n: int = 64  # the window the penalties count tokens in (prompt included); 0 = none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int = 0  # return the sampled token's log-probability and this many top alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                           or self.frequency_penalty != 0.0)


GREEDY = Sampling()
# the sampling options by name, as a wire message or an HTTP body names them (logprobs aside: each API asks
# for it its own way): a Sampling is built from a map by these names, never by position
SAMPLING_OPTIONS = tuple(f for f in Sampling.__dataclass_fields__ if f != "logprobs")


def model_names(text: str | None, default: str) -> tuple[str, list[str]]:
    """`served_model_name` (comma-separated names) -> (the model's id, its aliases): the id is the first name in
    alphabetical order, as llama-server's --alias makes it; unset, `default` alone."""
    names = sorted({n.strip() for n in (text or "").split(",") if n.strip()}) or [default]
    return names[0], names


def sampling_defaults(text: str | None) -> dict:
    """`--sampling-defaults` (a JSON object of OpenAI's sampling names: temperature, top_p, top_k, min_p, seed,
    the penalties; llama-server's --temp, --seed and the like, vLLM's generation config) -> the map; ValueError
    naming what is wrong."""
    if not text:
        return {}
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"sampling defaults are not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("sampling defaults must be a JSON object")
    for k, v in d.items():
        if k not in SAMPLING_OPTIONS:
            raise ValueError(f"sampling defaults: unknown option {k!r}; known: {', '.join(SAMPLING_OPTIONS)}")
        whole = k in ("seed", "top_k", "repeat_last_n")
        if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)):
            raise ValueError(f"sampling defaults: {k} must be {'an int' if whole else 'a number'}")
    return d


@dataclass
class SeqChunk:
    """Tokens for one sequence at positions pos .. pos+len-1 in this tick.

    `draw` >= 0 asks for a token to be sampled from the chunk's last row, using the session's
    `draw`-th random number (the index of the token generated); -1 means no sample (a middle
    prompt chunk). `sampling` rides on the sequence's first chunk (pos 0, or the first
    position after reused KV; None there means greedy); the engine remembers it until the
    sequence is released or trimmed.

    `follow` marks a one-token chunk whose token is the one this sequence sampled in the tick
    before, which the front has not seen yet when it plans one tick ahead (its token here is
    -1); the engine process fills it in (meshnode/engine/followups.py) before the engine runs.

    `embed` marks an embedding session's chunk (engine/embeddings.py): its rows' final hidden states
    are pooled, and where it asks a draw, the session's pooled, L2-normalized vector is its result.
    """

    seq_id: int
    pos: int
    tokens: np.ndarray
    draw: int = -1
    sampling: Sampling | None = None
    follow: bool = False
    constraint: Constrained | None = None
    embed: str = ""  # an embedding session's chunk: how its rows pool (mean, cls, last); its draw asks the vector


class Release(NamedTuple):
    """Drop the sequence's KV; its id is free."""
    seq_id: int


class Keep(NamedTuple):
    """The sequence keeps its first `n` positions and drops the rest: a new session takes over a
    cached one's KV where their tokens agree (the prefix cache)."""
    seq_id: int
    n: int


class Share(NamedTuple):
    """The empty sequence `dst` starts with the first `n` positions of `src` (llama_memory_seq_cp:
    cells shared in a unified pool, the stream copied across streams)."""
    src: int
    dst: int
    n: int


class Save(NamedTuple):
    """Write the sequence's first `n` positions (cells past them are dropped first) and their tokens to the
    file `path`, in llama.cpp's own per-sequence state format (llama_state_seq_save_file): a session leaving
    for another node takes its KV with it (core/moves.py)."""
    seq_id: int
    n: int
    path: str


class Load(NamedTuple):
    """The empty sequence starts with the KV a `Save` wrote to `path`, cut to its first `n` positions: a
    session that arrived from another node goes on from there. A file that cannot be loaded, or holds fewer
    positions, is a cache miss of that sequence (its session ends CACHE_MISS, the others go on)."""
    seq_id: int
    n: int
    path: str


KvOp = Union[Release, Keep, Share, Save, Load]


@dataclass
class Plan:
    """One tick: `release` runs first, then `kv` in order (each op sees the ones before it), then the
    chunks, which start where those left each sequence. `steps` > 1 (every chunk a one-token row that
    samples): the rows run that many times in a row, each step's sample the next step's token and its draw
    the next, so each sequence gains `steps` positions and samples (core/steps.py says when). `ends`: in such
    a tick, the tokens on which a row's session ends (the model's end of generation, its stop tokens): the
    row stops at one, since the steps after it would be computed for nothing and its client wait for them."""
    chunks: list[SeqChunk] = field(default_factory=list)
    release: list[int] = field(default_factory=list)
    kv: list[KvOp] = field(default_factory=list)
    steps: int = 1
    ends: dict[int, frozenset[int]] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    @property
    def reads_kv(self) -> bool:
        """Its KV operations read positions of a sequence (a keep, a share, a save): what the ticks before
        it were planned to compute."""
        return any(not isinstance(op, (Release, Load)) for op in self.kv)

    @property
    def restarted(self) -> set[int]:
        """Sequences whose KV this plan drops or rewrites before its chunks run."""
        if not (self.release or self.kv):
            return set()  # most ticks restart nothing
        return {*self.release, *(op.seq_id for op in self.kv if not isinstance(op, Share)),
                *(op.dst for op in self.kv if isinstance(op, Share))}


class Logprob(NamedTuple):
    """A sampled token's log-probability and the most likely tokens' (token, logprob), best first: one shape
    from the engine's sampler to the client's `tokens` event."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class StepResult:
    tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled token
    cache_miss: list[int] = field(default_factory=list)  # sequences whose KV was lost
    step_ms: float = 0.0
    kv_cells: int = 0  # KV cells in use after the step
    logprobs: dict[int, Logprob] = field(default_factory=dict)  # for the sessions that asked
    drafted: int = 0  # draft tokens verified as rows of their sequences (engine/drafts.py)
    served: int = 0  # tokens answered from drafts an earlier tick verified
    # seq_id -> why its response_format failed (the library's words): that session ends, the tick goes on
    failed: dict[int, str] = field(default_factory=dict)
    # a multi-step tick (Plan.steps): seq_id -> the samples of its steps before the last, in order, with their
    # log-probabilities (None where not asked); `tokens` and `logprobs` are the last step's
    earlier: dict[int, list[tuple[int, Logprob | None]]] = field(default_factory=dict)
    embeddings: dict[int, list[float]] = field(default_factory=dict)  # an embedding session's pooled vector
    saved: dict[int, int] = field(default_factory=dict)  # a Save's sequence -> the bytes written (0: it failed)
    # chunks left undone: the front asked the tick to hurry (link.Hurry: a better first token waits) and their
    # llama_decode call was stopped or not begun; their sequences' KV is as before them, they are planned again
    deferred: list[int] = field(default_factory=list)
    steps: int = 1  # the steps it ran: a hurried multi-step tick (link.Hurry) stops early, a running step undone whole
    # follow rows left out: the tick before sampled a token that ends their session (Plan.ends), which has ended
    ended: list[int] = field(default_factory=list)

    def samples(self, seq_id: int) -> list[tuple[int, Logprob | None]]:
        """Every sample the tick drew for the sequence, in order, with its log-probabilities."""
        last = [(self.tokens[seq_id], self.logprobs.get(seq_id))] if seq_id in self.tokens else []
        return self.earlier.get(seq_id, []) + last


@dataclass(frozen=True)
class Device:
    """A device llama.cpp spread the model over, and what of the model it holds (meshnode/engine/devices.py)."""

    name: str  # llama.cpp's: CPU, CUDA0, RPC0, ...
    kind: str  # cpu, gpu, igpu, accel (an RPC worker's device counts as a gpu, whatever it runs on)
    endpoint: str  # HOST:PORT of an RPC worker, "" for a device of this host
    mem_total: int
    mem_free: int
    layers: tuple[int, ...] = ()  # the model's layers placed on it (n_layer = the output layer)
    weight_bytes: int = 0  # its model buffers
    kv_bytes: int = 0  # its KV cache buffers


@dataclass(frozen=True)
class EngineInfo:
    """An engine's shape: what budgets derive from and what the front checks every incarnation against."""

    n_vocab: int
    eos: int
    eog: tuple[int, ...]  # every end-of-generation token (EOS, EOT, ...)
    n_seq_max: int
    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    kv_bytes_per_token: int
    weight_bytes: int
    recipe: str
    deterministic: bool = False  # in effect: a sequence's numbers do not depend on its neighbours
    deterministic_problem: str = ""  # why not, where it was left to the engine (one line, with the fix)
    calibration: tuple = ()  # ((calls, rows, attention, attention in small calls, sized, ms), ...): core/costmodel.py: ticks of known shapes the engine ran at start
    devices: tuple[Device, ...] = ()  # where the model is, when llama.cpp reports it (the llama engine)
    # ipc/seqstate.Layout.wire(): what its KV state files hold; () where it cannot say (no KV imports)
    kv_state: tuple = ()
    kernels: str = ""  # the llama.cpp build and its repacked weights (engine/llamacpp.py, kernels); "" unknown

    @property
    def host_weight_bytes(self) -> int:
        """The weights in this host's memory: the CPU's share where the model is spread over devices (a
        GPU's VRAM and an RPC worker's memory are theirs), all of them where nothing says otherwise."""
        if not any(d.kind != "cpu" for d in self.devices):
            return self.weight_bytes
        return sum(d.weight_bytes for d in self.devices if d.kind == "cpu" and not d.endpoint)

    def placement(self) -> dict:
        """The offload settings that put every layer where this incarnation's are, for the next one: by
        default llama.cpp splits layers by the devices' free memory, which moves, and a restart placed
        differently would compute another recipe and be refused. {} when nothing is offloaded."""
        off = [d for d in self.devices if d.kind != "cpu" and d.layers]
        if not off:
            return {}
        return {"gpu_layers": sum(len(d.layers) for d in off), "devices": tuple(d.name for d in off),
                "tensor_split": tuple(float(len(d.layers)) for d in off)}

    @classmethod
    def of(cls, engine, calibration: tuple = ()) -> "EngineInfo":
        return cls(engine.n_vocab, engine.eos, tuple(engine.eog), engine.n_seq_max, engine.n_ctx, engine.n_ctx_seq,
                   engine.n_batch, engine.kv_bytes_per_token, engine.weight_bytes, engine.recipe_fingerprint,
                   bool(getattr(engine, "deterministic", False)), getattr(engine, "deterministic_problem", ""),
                   tuple(tuple(x) for x in calibration), tuple(getattr(engine, "devices", ())),
                   kernels=getattr(engine, "kernels", ""))
