"""Sessions that leave for another node with their KV, and sessions that arrive with it.

A router drains or rebalances a node by taking a live session off it (`export`)
and giving its state to a node on the same recipe (`import`). Re-prefilling the
prompt and what it generated there costs a prefill of the whole context; moving
llama.cpp's own per-sequence state (the KV cells and their tokens) costs a file
read and write, and the cells are the ones the session had, so what it samples
next is bitwise what it would have sampled without moving, wherever the node's
numbers are (deterministic mode: always).

Leaving: the session stops being planned the moment its export is asked; ticks
already in flight still land (their tokens stream to its client as usual), and
the next plan saves its sequence (`Save`, which runs before any chunk of that
tick, after every tick before it). When that tick is answered the session ends
EXPORTED, its `exported` event carrying the file. A session that ends first
(its last token, a cancel, a drain) gets its own `done`; its export is answered
with that. Nothing computed yet (it waits for its first chunk, or its KV was
lost): it leaves at once, without KV, and is prefilled where it goes.

Arriving: a session admitted with KV takes a free sequence and loads the file
(`Load`) as the tick that first computes for it begins; it reuses every position
but the last (whose logits give its first sample), the way a prefix-cache hit
does. A file the engine cannot load is a cache miss: that session ends
CACHE_MISS with the tokens it has, which a client resubmits (docs/protocol.md).
"""
from __future__ import annotations

from meshnode.core.session import Event, Session
from meshnode.core.types import Load, Save


def saves(running: list[Session]) -> tuple[list[Save], list[Session]]:
    """The Save operations the next plan carries and the sessions they belong to: every session asked to
    leave whose save is not planned yet (one with nothing computed leaves without one)."""
    ops, leaving = [], []
    for s in running:
        if s.export_to and not s.saving:
            s.saving = True
            if s.n_planned:
                ops.append(Save(s.seq_id, s.n_planned, s.export_to))
            leaving.append(s)
    return ops, leaving


def exported(s: Session, saved: dict[int, int]) -> Event:
    """The `exported` event of a session whose save ran: with its KV file where the engine wrote it."""
    n = saved.get(s.seq_id, 0) if s.n_planned else 0
    return Event("exported", s, kv=(s.export_to, s.n_planned, n) if n > 0 else None)


def load(s: Session, seq_id: int) -> Load | None:
    """The Load that starts an arriving session on `seq_id` (every position but the last), or None when its
    KV holds nothing it can reuse; either way the file is the session's no more."""
    path, positions = s.kv_import
    s.kv_import = None
    n = min(positions, len(s.tokens) - 1)
    return Load(seq_id, n, path) if n > 0 else None
