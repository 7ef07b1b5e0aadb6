"""Every engine-link message, typed, and their msgpack form: the front and the engine process both use this file.

One msgpack map per message over the link socket (ipc/seqpacket.py), with a
`kind`; `encode` and `decode` are the only code that reads or writes those
maps, so nothing else ever handles a raw dict. A tick's prompt token ids
travel through the shared-memory arena (ipc/shm.py), never through msgpack;
its sampled ids, one per sampling chunk, come back in its TickDone.

Two ticks may be in flight (the front plans one ahead), so the arena has two
halves and tick t uses half t % 2. The front writes tick t+2's tokens only
after tick t's answer has arrived, and by then the engine has read tick t's.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from ipc import seqpacket, seqstate
from ipc.protocol import pack, unpack
from meshnode.core.types import (POOLINGS, Constrained, Device, EngineInfo, Grammar, Keep, Load, Logprob, Plan,
                                 Release, Sampling, Save, SeqChunk, Share, StepResult)

HALVES = 2
MAX_GRAMMAR_BYTES = seqpacket.MAX_MESSAGE - 4096  # a compiled grammar and its message's other fields
GRAMMARS_KEPT = 256  # grammars an engine holds at once (well above the sequences one tick can start)
_SAMPLING = [f.name for f in fields(Sampling)]
_INFO = [f.name for f in fields(EngineInfo)]
_KV_OPS = {0: Release, 1: Keep, 2: Share, 3: Save, 4: Load}  # a tick's KV operations travel as [code, *fields]
_KV_CODES = {v: k for k, v in _KV_OPS.items()}


# -- front -> engine ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TickRequest:
    """Run `plan` as tick `tick`. `resync` ends the refusals that follow a refused tick; `fresh` says
    the engine was idle, so this is new work, not the answer to its last reply."""

    tick: int
    plan: Plan
    resync: bool = False
    fresh: bool = False


@dataclass(frozen=True)
class GrammarText:
    """A compiled output grammar, sent once per engine incarnation ahead of the first tick that names it
    (a tick carries only keys: eight new sessions' schemas would not fit one message); `forget`: keys
    no tick will name any more (GrammarsSent decides)."""

    grammar: Grammar
    forget: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stop:
    """Exit cleanly."""


@dataclass(frozen=True)
class Hurry:
    """Ticks up to `tick` are to leave undone what they can (StepResult.deferred): a request of a better
    priority arrived, and its first token waits for them. One not begun runs none of its chunks (its KV
    operations only); the one running stops the llama_decode call it is in and skips the rest (a multi-step
    tick: it stops between steps). Read by the engine's link reader as it arrives, never queued behind the
    ticks it names."""

    tick: int


# -- engine -> front ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    pid: int
    info: EngineInfo


@dataclass(frozen=True)
class HelloFailed:
    detail: str


@dataclass(frozen=True)
class Aborted:
    """The engine's last words when ggml aborts the process (a GGML_ASSERT)."""

    detail: str


@dataclass(frozen=True)
class TickDone:
    """Tick `tick` ran: the engine's StepResult, whole (`check_samples` judges its tokens against the
    tick). `gap_ms`: the engine's time between the previous tick's step and this one's (-1 for a fresh
    tick). The memory figures are the engine process's latest (re-read at most every
    0.25 s)."""

    tick: int
    result: StepResult = field(default_factory=StepResult)
    gap_ms: float = -1.0
    rss: int = 0
    mem_available: int = 0
    mem_total: int = 0


@dataclass(frozen=True)
class TickRefused:
    tick: int
    fatal: bool
    detail: str


Message = TickRequest | GrammarText | Stop | Hurry | Hello | HelloFailed | Aborted | TickDone | TickRefused


class GrammarsSent:
    """The front's record of the grammars its engine incarnation holds: which GrammarText messages must
    precede a tick, and which old ones the engine may drop (least recently named first)."""

    def __init__(self, keep: int = GRAMMARS_KEPT):
        self.keep = keep
        self._keys: dict[str, None] = {}  # insertion order = least recently named first

    def ahead_of(self, plan: Plan) -> list[GrammarText]:
        named = {c.constraint.grammar.key: c.constraint.grammar for c in plan.chunks if c.constraint is not None}
        for key in named:
            if key in self._keys:
                self._keys[key] = self._keys.pop(key)
        out = []
        for key, grammar in named.items():
            if key not in self._keys:
                self._keys[key] = None
                spare = [k for k in self._keys if k not in named][:max(0, len(self._keys) - self.keep)]
                for k in spare:
                    del self._keys[k]
                out.append(GrammarText(grammar, tuple(spare)))
        return out


# -- the spawn ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineProcessConfig:
    """What the front gives each engine incarnation, through the spawn (pickled), before the link exists."""

    link_path: str
    parent_pid: int
    arena_name: str
    arena_input: int
    engine: object  # its meshnode.engine.config.EngineConfig (pickled with the spawn)
    log_level: str  # the node's log_level
    generation: int  # this incarnation's number, from 1
    factory: str = ""  # "module:callable" that builds the engine (the node's engine_factory); "": llama.cpp's
    factory_args: dict | None = None  # what the node's engine_args give the factory
    calibrate: bool = False  # time ticks of known shapes before the hello (the first incarnation only)


# -- the arena ------------------------------------------------------------------------------------
def arena_tokens(n_batch: int) -> int:
    """The arena's size in tokens: it holds every tick in flight."""
    return HALVES * n_batch


def _base(tick: int, arena) -> int:
    return (tick % HALVES) * (arena.n_input // HALVES)


def check_samples(tokens: dict[int, int], plan: Plan, n_vocab: int, absent=()) -> None:
    """The front's side: a token for each sampling chunk of the tick and no other, but for the sequences
    `absent` (the engine said they drew none: a cache miss, a failed constraint). ValueError otherwise,
    or for a token outside the vocabulary: the engine is broken, and detokenizing it would abort the front
    (llama.cpp throws std::out_of_range)."""
    want = {c.seq_id for c in plan.chunks if c.draw >= 0 and not c.embed and c.seq_id not in absent}
    if tokens.keys() != want:  # an embedding's result is its vector
        raise ValueError(f"engine sampled for sequences {sorted(tokens)[:8]}, the tick's are {sorted(want)[:8]}")
    for seq, tok in tokens.items():
        if not 0 <= tok < n_vocab:
            raise ValueError(f"engine sampled token {tok} for sequence {seq}, outside the vocabulary of {n_vocab}")


def check_earlier(earlier: dict, plan: Plan, last: dict, n_vocab: int, steps: int) -> None:
    """A multi-step tick's earlier samples (StepResult.earlier), as check_samples checks the last: only of the
    plan's sequences, inside the vocabulary, and steps - 1 of them for each sequence with a last sample
    (`last`) unless that sample ends it (Plan.ends: it stopped there), fewer for one that dropped out, where
    `steps` (StepResult.steps: fewer than planned when a hurry stopped the tick) is 1 to plan.steps;
    ValueError otherwise."""
    seqs = {c.seq_id for c in plan.chunks}
    if not 1 <= steps <= plan.steps:
        raise ValueError(f"engine ran {steps} steps of a {plan.steps}-step tick")
    for seq in seqs | set(earlier):
        n = len(earlier.get(seq, ()))
        stopped = seq in last and last[seq] in plan.ends.get(seq, ())
        if seq not in seqs or n >= steps or (seq in last and n != steps - 1 and not stopped):
            raise ValueError(f"engine sent {n} earlier samples for sequence {seq} of a {steps}-step tick")
        if any(not 0 <= t < n_vocab for t, _ in earlier.get(seq, ())):
            raise ValueError(f"engine sampled a token for sequence {seq} outside the vocabulary of {n_vocab}")


def check_embeddings(embeddings: dict, plan: Plan) -> None:
    """A tick's embedding vectors: only for the plan's embedding chunks that asked for one, finite."""
    asked = {c.seq_id for c in plan.chunks if c.embed and c.draw >= 0}
    for seq, v in embeddings.items():
        if seq not in asked or not v or not all(math.isfinite(x) for x in v):
            raise ValueError(f"engine sent an embedding for sequence {seq}, which asked none or is not finite")


class MalformedTick(ValueError):
    """A tick whose fields do not decode, with its number when that is readable: refused in its place."""

    def __init__(self, tick: int, detail: str):
        super().__init__(detail)
        self.tick = tick


# -- msgpack ----------------------------------------------------------------------------------------
def encode(msg: Message, arena=None) -> bytes:
    """The message's bytes; a TickRequest's tokens go into `arena` on the way."""
    if isinstance(msg, TickRequest):
        return pack(_tick_map(msg, arena))
    if isinstance(msg, Hello):
        return pack({"kind": "hello", "pid": msg.pid, "info": {**asdict(msg.info), "eog": list(msg.info.eog)}})
    if isinstance(msg, GrammarText):
        return pack({"kind": "grammar", "key": msg.grammar.key, "text": msg.grammar.text, "forget": list(msg.forget)})
    if isinstance(msg, TickDone):
        r = msg.result
        return pack({"kind": "done", "tick": msg.tick, "tokens": [list(r.tokens), list(r.tokens.values())],
                     "gap_ms": msg.gap_ms, "rss": msg.rss,
                     "mem_available": msg.mem_available, "mem_total": msg.mem_total,
                     "cache_miss": list(r.cache_miss), "step_ms": r.step_ms, "kv_cells": r.kv_cells,
                     "logprobs": [[s, lp.logprob, [list(t) for t in lp.top]] for s, lp in r.logprobs.items()],
                     "drafted": r.drafted, "served": r.served, "failed": [list(f) for f in r.failed.items()],
                     **({"earlier": [[s, [t for t, _ in xs], [_logprob(lp) for _, lp in xs]]
                                     for s, xs in r.earlier.items()]} if r.earlier else {}),
                     **({"embeddings": [[s, v] for s, v in r.embeddings.items()]} if r.embeddings else {}),
                     **({"saved": [list(x) for x in r.saved.items()]} if r.saved else {}),
                     **({"deferred": list(r.deferred)} if r.deferred else {}),
                     **({"steps": r.steps} if r.steps != 1 else {}),
                     **({"ended": list(r.ended)} if r.ended else {})})
    kind = {Stop: "stop", Hurry: "hurry", HelloFailed: "hello_failed", Aborted: "aborted",
            TickRefused: "refused"}[type(msg)]
    return pack({"kind": kind, **asdict(msg)})


def _tick_map(msg: TickRequest, arena) -> dict:
    off = _base(msg.tick, arena)
    buf, cols = arena.input, {"seq": [], "pos": [], "offset": [], "n": [], "draw": []}
    sampling, follow, constraint, embed = [], [], [], []
    for c in msg.plan.chunks:
        n = len(c.tokens)
        buf[off:off + n] = c.tokens
        for k, v in (("seq", c.seq_id), ("pos", c.pos), ("offset", off), ("n", n), ("draw", c.draw)):
            cols[k].append(int(v))
        if c.sampling is not None:
            sampling.append({"seq": c.seq_id, **asdict(c.sampling)})
        if c.constraint is not None:
            constraint.append({"seq": c.seq_id, "key": c.constraint.grammar.key, "n_prompt": c.constraint.n_prompt})
        if c.follow:
            follow.append(c.seq_id)
        if c.embed:
            embed.append([c.seq_id, c.embed])
        off += n
    return {"kind": "tick", "tick": msg.tick, "release": [int(s) for s in msg.plan.release],
            "kv": [[_KV_CODES[type(op)], *(v if isinstance(v, str) else int(v) for v in op)] for op in msg.plan.kv],
            **cols,
            "sampling": sampling, "follow": follow, "resync": msg.resync, "fresh": msg.fresh,
            **({"constraint": constraint} if constraint else {}), **({"embed": embed} if embed else {}),
            **({"steps": msg.plan.steps} if msg.plan.steps != 1 else {}),
            **({"ends": [[s, sorted(t)] for s, t in msg.plan.ends.items()]} if msg.plan.ends else {})}


def decode(data, arena=None, grammars: dict | None = None) -> Message:
    """A message from its bytes; ValueError names what is malformed. A TickRequest's tokens are copied
    out of `arena`, its constraints' grammars looked up in `grammars` (key -> Grammar, as GrammarText
    messages left them)."""
    m = unpack(data, max_bytes=seqpacket.MAX_MESSAGE)  # no link message can be larger than the socket carries
    if not isinstance(m, dict):
        raise ValueError("engine link message is not a map")
    kind = m.get("kind")
    if kind == "tick":
        try:
            return _tick_request(m, arena, grammars or {})
        except (KeyError, TypeError, ValueError) as e:
            raise MalformedTick(m["tick"] if isinstance(m.get("tick"), int) else 0, f"malformed tick: {e}") from None
    try:
        if kind == "done":
            seqs, toks = m["tokens"]
            result = StepResult(dict(zip(_ints(seqs, "tokens"), _ints(toks, "tokens"), strict=True)),
                                list(_ints(m["cache_miss"], "cache_miss")), float(m["step_ms"]),
                                int(m["kv_cells"]), _logprobs(m.get("logprobs", [])), int(m.get("drafted", 0)),
                                int(m.get("served", 0)), {int(q): str(why) for q, why in m.get("failed", [])},
                                _earlier(m.get("earlier", [])),
                                {int(q): [float(x) for x in v] for q, v in m.get("embeddings", [])},
                                {int(q): int(n) for q, n in m.get("saved", [])},
                                list(_ints(m.get("deferred", []), "deferred")), int(m.get("steps", 1)),
                                list(_ints(m.get("ended", []), "ended")))
            return TickDone(int(m["tick"]), result, float(m["gap_ms"]), int(m["rss"]), int(m["mem_available"]),
                            int(m["mem_total"]))
        if kind == "refused":
            return TickRefused(m["tick"], bool(m["fatal"]), str(m["detail"]))
        if kind == "hello":
            info = m["info"]
            return Hello(m["pid"], EngineInfo(**{k: info[k] for k in _INFO} | {
                "eog": tuple(info["eog"]), "calibration": tuple((int(c), int(r), float(a), float(s), bool(z), float(ms))
                                       for c, r, a, s, z, ms in info["calibration"]),
                "devices": tuple(Device(**{**d, "layers": tuple(d["layers"])}) for d in info["devices"]),
                "kv_state": _kv_state(info["kv_state"])}))
        if kind == "grammar":
            if not isinstance(m["text"], str) or not isinstance(m["key"], str):
                raise ValueError("grammar key and text must be strings")
            return GrammarText(Grammar(m["key"], m["text"]), tuple(str(k) for k in m["forget"]))
        if kind == "hello_failed":
            return HelloFailed(str(m["detail"]))
        if kind == "aborted":
            return Aborted(str(m["detail"]))
        if kind == "stop":
            return Stop()
        if kind == "hurry":
            return Hurry(int(m["tick"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed engine link message {kind!r}: {e!r}") from None
    raise ValueError(f"unknown engine link message kind {kind!r}")


def _kv_state(v) -> tuple:
    layout = seqstate.Layout.of(v)
    return layout.wire() if layout else ()


def _logprobs(v) -> dict[int, Logprob]:
    return {int(seq): _logprob_of(lp, top) for seq, lp, top in v}


def _logprob_of(lp, top) -> Logprob:
    return Logprob(float(lp), tuple((int(t), float(p)) for t, p in top))


def _logprob(lp: Logprob | None) -> list | None:
    return None if lp is None else [lp.logprob, [list(t) for t in lp.top]]


def _earlier(v) -> dict[int, list[tuple[int, Logprob | None]]]:
    """A multi-step tick's samples before its last step (StepResult.earlier)."""
    out = {}
    for seq, toks, lps in v:
        if len(toks) != len(lps):
            raise ValueError("earlier samples and log-probabilities differ in length")
        out[int(seq)] = [(int(t), None if lp is None else _logprob_of(*lp))
                         for t, lp in zip(_ints(toks, "earlier"), lps)]
    return out


def _ints(v, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) for x in v):
        raise ValueError(f"tick field {name!r} is not a list of integers")
    return v


def _kv_op(op) -> object:
    """[code, *fields]: integers, but for a Save's or Load's path."""
    kind = _KV_OPS.get(op[0]) if isinstance(op, list) and op and isinstance(op[0], int) else None
    if kind is None or len(op) != len(kind._fields) + 1 or not all(
            isinstance(v, str if f == "path" else int) for f, v in zip(kind._fields, op[1:])):
        raise ValueError(f"malformed KV operation {str(op)[:80]!r}")
    return kind(*op[1:])


def _tick_request(m: dict, arena, grammars: dict) -> TickRequest:
    cols = [_ints(m.get(k, []), k) for k in ("seq", "pos", "offset", "n", "draw")]
    if len({len(c) for c in cols}) != 1:
        raise ValueError("tick columns differ in length")
    sampling = {}
    for s in m.get("sampling", []):
        if not isinstance(s, dict) or set(s) != {"seq", *_SAMPLING}:
            raise ValueError(f"malformed sampling entry {s!r}")
        sampling[s["seq"]] = Sampling(**{k: s[k] for k in _SAMPLING})
    constraint = {}
    for c in m.get("constraint", []):
        if not isinstance(c, dict) or set(c) != {"seq", "key", "n_prompt"} or not isinstance(c["n_prompt"], int):
            raise ValueError(f"malformed constraint entry {str(c)[:80]!r}")
        if c["key"] not in grammars:
            raise ValueError(f"constraint names grammar {str(c['key'])[:40]!r}, which this engine was not sent")
        constraint[c["seq"]] = Constrained(grammars[c["key"]], c["n_prompt"])
    follow = set(_ints(m.get("follow", []), "follow"))
    embed = {}
    for e in m.get("embed", []):
        if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and e[1] in POOLINGS):
            raise ValueError(f"malformed embed entry {str(e)[:80]!r}")
        embed[e[0]] = e[1]
    tick = m.get("tick")
    if not isinstance(tick, int):
        raise ValueError(f"tick number {tick!r} is not an integer")
    chunks = []
    for seq, pos, off, n, draw in zip(*cols):
        if off < 0 or n < 0 or off + n > arena.n_input:
            raise ValueError(f"chunk of sequence {seq} points outside the arena")
        chunks.append(SeqChunk(seq, pos, arena.input[off:off + n].copy(), draw, sampling.get(seq), seq in follow,
                               constraint.get(seq), embed.get(seq, "")))
    kv = [_kv_op(op) for op in m.get("kv", [])]
    steps = m.get("steps", 1)
    if not isinstance(steps, int):
        raise ValueError(f"steps {steps!r} is not an integer")
    ends = {}
    for e in m.get("ends", []):
        if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], int)):
            raise ValueError(f"malformed ends entry {str(e)[:80]!r}")
        ends[e[0]] = frozenset(_ints(e[1], "ends"))
    return TickRequest(tick, Plan(chunks, _ints(m.get("release", []), "release"), kv, steps, ends),
                       bool(m.get("resync")), bool(m.get("fresh")))
