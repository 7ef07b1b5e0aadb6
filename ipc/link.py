"""Every engine-link message, in one place: the front and the engine process both use this file.

One msgpack map per message over the link socket (ipc/seqpacket.py). A tick's token ids
travel through the shared-memory arena (ipc/shm.py), never through msgpack.

Two ticks may be in flight (the front plans one ahead so the engine never
waits for it), so the arena has two halves and tick t uses half t % 2. The
front writes tick t+2's tokens only after tick t's reply has arrived, and by
then the engine has read tick t's tokens and the front has read its samples.

Tick:  {"t": n, "release": [seq, ...], "seqs": [[seq, pos, offset, n, draw, *sampling?], ...],
        "out": base, "follow": [seq, ...]?, "resync": true?, "fresh": true?}
    Entry k's tokens are arena.input[offset:offset+n]; its sampled token goes to
    arena.output[base + k] (-1 for none). `sampling` (4 numbers) rides on a sequence's first
    chunk (pos 0). A `follow` sequence decodes the token it sampled in the tick before
    (meshnode/engine/chain.py); `resync` ends the refusals that follow a refused tick; `fresh`
    says the engine was idle and this tick is new work, not the answer to its last reply.
Reply: {"t", "ok": true, "miss": [seq, ...], "ms", "kv_cells", "gap_ms", "rss", "mem": [avail, total]}
    `gap_ms`: the engine's time between the previous tick's step and this one's, the node's cost
    per tick (-1 for a fresh tick). `rss` and `mem` are re-read at most every 0.25 s.
    or {"t", "ok": false, "fatal": bool, "detail": str}.
"""
from __future__ import annotations

from ipc.protocol import MAX_MESSAGE_BYTES, pack, unpack
from meshnode.core.types import Plan, Sampling, SeqChunk, StepResult

HALVES = 2
STOP = pack({"stop": True})


def arena_shape(n_batch: int, n_seq_max: int) -> tuple[int, int]:
    """(input, output) sizes in tokens for an arena that holds every tick in flight."""
    return HALVES * n_batch, HALVES * n_seq_max


def _bases(t: int, arena) -> tuple[int, int]:
    half = t % HALVES
    return half * (arena.n_input // HALVES), half * (arena.n_output // HALVES)


def encode_tick(t: int, plan: Plan, arena, resync: bool = False, fresh: bool = False) -> bytes:
    """Tick t: its tokens into the arena's half for t, the rest into one small map."""
    off, out = _bases(t, arena)
    buf, seqs, follow = arena.input, [], []
    for c in plan.chunks:
        n = len(c.tokens)
        buf[off:off + n] = c.tokens
        entry = [c.seq_id, c.pos, off, n, c.draw]
        seqs.append(entry + c.sampling.as_list() if c.sampling is not None else entry)
        if c.follow:
            follow.append(c.seq_id)
        off += n
    msg = {"t": t, "release": list(plan.release), "seqs": seqs, "out": out}
    if follow:
        msg["follow"] = follow
    if resync:
        msg["resync"] = True
    if fresh:
        msg["fresh"] = True
    return pack(msg)


def _ints(v, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) for x in v):
        raise ValueError(f"tick field {name!r} is not a list of integers")
    return v


def decode_tick(msg: dict, arena) -> tuple[Plan, int, bool]:
    """(plan, output base, resync) of a tick; ValueError names what is malformed."""
    seqs = msg.get("seqs", [])
    if not isinstance(seqs, list):
        raise ValueError("tick field 'seqs' is not a list")
    follow = set(_ints(msg.get("follow", []), "follow"))
    out = msg.get("out", 0)
    if not isinstance(out, int) or out < 0 or out + len(seqs) > arena.n_output:
        raise ValueError(f"tick output base {out!r} does not fit {len(seqs)} entries in the arena")
    chunks = []
    for e in seqs:
        if not isinstance(e, list) or len(e) not in (5, 9) or not all(isinstance(x, int) for x in e[:5]) \
                or not all(isinstance(x, (int, float)) for x in e[5:]):
            raise ValueError(f"malformed tick entry {e!r}")
        seq, pos, off, n, draw = e[:5]
        if off < 0 or n < 0 or off + n > arena.n_input:
            raise ValueError(f"tick entry {e!r} points outside the arena")
        sampling = Sampling.from_list(e[5:]) if len(e) == 9 else None
        chunks.append(SeqChunk(seq, pos, arena.input[off:off + n].copy(), draw, sampling, seq in follow))
    return Plan(chunks, _ints(msg.get("release", []), "release")), out, bool(msg.get("resync"))


def write_samples(arena, out: int, plan: Plan, res: StepResult) -> None:
    """The engine's side: entry k's sampled token (or -1) into arena.output[out + k]."""
    for k, c in enumerate(plan.chunks):
        arena.output[out + k] = res.tokens.get(c.seq_id, -1)


def read_result(msg: dict, plan: Plan, arena, n_vocab: int) -> StepResult:
    """The front's side: a successful reply to `plan` plus its samples from the arena. A sample
    outside the vocabulary raises ValueError: the engine is broken, and detokenizing it would
    abort the front (llama.cpp throws std::out_of_range)."""
    _, out = _bases(msg["t"], arena)
    samples = arena.output
    tokens = {c.seq_id: int(samples[out + k]) for k, c in enumerate(plan.chunks) if c.draw >= 0}
    for seq, tok in tokens.items():
        if not 0 <= tok < n_vocab:
            raise ValueError(f"engine sampled token {tok} for sequence {seq}, outside the vocabulary of {n_vocab}")
    return StepResult(tokens, list(msg.get("miss", [])), float(msg.get("ms", 0.0)), int(msg.get("kv_cells", 0)))


def tick_ok(t, miss: list[int], step_ms: float, kv_cells: int, gap_ms: float) -> dict:
    """Without the memory figures: the engine's writer thread adds its latest "rss" and "mem"."""
    return {"t": t, "ok": True, "miss": miss, "ms": step_ms, "kv_cells": kv_cells, "gap_ms": gap_ms}


def tick_failed(t, fatal: bool, detail: str) -> dict:
    return {"t": t, "ok": False, "fatal": fatal, "detail": detail}


def hello(info: dict) -> bytes:
    """The engine's first message: its shape (n_vocab, n_seq_max, ..., recipe, pid)."""
    return pack({"hello": info})


def hello_failed(detail: str) -> bytes:
    return pack({"hello_error": detail})


def aborted(detail: str) -> bytes:
    """The engine's last words when ggml aborts the process (a GGML_ASSERT): why it is dying."""
    return pack({"abort": detail})


def unpack_message(data: bytes) -> dict:
    msg = unpack(data, max_bytes=16 * MAX_MESSAGE_BYTES)
    if not isinstance(msg, dict):
        raise ValueError("engine link message is not a map")
    return msg
