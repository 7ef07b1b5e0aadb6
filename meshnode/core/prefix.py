"""The prefix cache: a finished session's KV stays on its sequence until someone needs the room.

Chat clients re-send the whole conversation every turn, and many prompts open
with the same system text. A session whose tokens start with tokens whose KV the
engine still holds prefills only the rest. Two sources:
- a finished session's sequence (an *entry*): the new session takes the sequence
  over and trims it where the tokens part (`Keep`), the way llama-server reuses a
  slot; when the entry holds more that another prompt could reuse than the new
  session shares, the shared part is copied instead (`Share`) and the entry stays
  for whoever continues it;
- a live session's computed tokens (`Share`), e.g. a system prompt that another
  session is already decoding after; when that session is still computing them
  (users sending one system prompt at the same moment), the new session waits
  for it (a *leader*) and then copies, instead of computing the same tokens
  alongside it.
At least the last prompt token is always recomputed: its logits give the first sample.

Cached KV is never reserved KV: entries hold no admission reservation, and the
scheduler evicts the least recently used one the moment a new session needs its
sequence id or its cells, so the cache never causes a rejection, a wait or a miss.
A hit is visibly faster, so who may reuse whose KV is a setting (`scope`):
`client` (only sessions of the same client identity), `node` (everyone), `off`.

In deterministic mode a reused cell must be one a cold run computes with the same
kernel (engine/invariant.py): only a prompt's own cells, from a prompt of at least
TILE_ROWS tokens (computed in tiles), and the new prompt keeps at least TILE_ROWS
tokens to compute (in tiles too). Generated tokens' cells are recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import numpy as np

from meshnode.core.costmodel import TILE_ROWS
from meshnode.core.kvevents import BlockIndex, block_hashes

SCOPES = ("client", "node", "off")
MIN_SHARE = 16  # a copy across streams costs the whole stream: not worth it for a few tokens


@dataclass
class Entry:
    seq_id: int
    tokens: np.ndarray  # the tokens whose KV the sequence holds, from position 0
    cells: int  # positions the engine holds for it (a pipelined tick may have added one more)
    owner: Hashable
    used: int  # the cache's clock when it was stored or last hit
    n_prompt: int = 0  # how many of `tokens` were its prompt (the rest it generated)


@dataclass(frozen=True)
class Hit:
    seq_id: int  # where the prefix is
    n: int  # positions to reuse
    entry: bool  # a cached entry (else a live session's sequence)
    takeover: bool  # take the entry's sequence over (else copy the prefix into a new one)


@dataclass
class CacheCounters:
    hits: int = 0
    hit_tokens: int = 0  # prefill tokens not computed thanks to the cache
    evictions: int = 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class PrefixCache:
    def __init__(self, scope: str = "client", deterministic: bool = False, events: bool = False):
        """`events`: keep the cache's block events for routers (core/kvevents.py)."""
        if scope not in SCOPES:
            raise ValueError(f"prefix cache scope must be one of {SCOPES}, got {scope!r}")
        self.scope, self.deterministic = scope, deterministic
        self.entries: dict[int, Entry] = {}  # seq_id -> entry
        self.blocks = BlockIndex(events and self.on)
        self.counters = CacheCounters()
        self._clock = 0

    @property
    def on(self) -> bool:
        return self.scope != "off"

    @property
    def cells(self) -> int:
        return sum(e.cells for e in self.entries.values())

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _mine(self, owner: Hashable, other: Hashable) -> bool:
        return self.scope == "node" or owner == other

    def _usable(self, n: int, n_src_prompt: int, n_prompt: int) -> int:
        """How many of `n` shared positions may be reused (all but the last prompt token; in deterministic
        mode only tiled prompt cells, leaving a tile to compute)."""
        n = min(n, n_prompt - 1)
        if self.deterministic:
            n = min(n, n_src_prompt if n_src_prompt >= TILE_ROWS else 0, n_prompt - TILE_ROWS)
        return max(n, 0)

    def _worth(self, e: Entry) -> int:
        """The most any prompt could reuse of an entry. In deterministic mode only a long prompt's own cells
        are: a conversation's next turn reuses all of them, so it takes the sequence over instead of copying
        them into another (which took a second id; with as many conversations as ids, each copy evicted the
        entry of the user next in line, who then reused only the shared system prompt)."""
        if self.deterministic:
            return min(len(e.tokens) - 1, e.n_prompt if e.n_prompt >= TILE_ROWS else 0)
        return len(e.tokens) - 1

    def store(self, seq_id: int, tokens: list[int], cells: int, owner: Hashable, n_prompt: int = 0) -> bool:
        """Keep a finished session's sequence; False when the cache is off or there is nothing to keep
        (the caller releases it)."""
        n = min(len(tokens), cells)
        if not self.on or n < 1:
            return False
        e = self.entries[seq_id] = Entry(seq_id, np.asarray(tokens[:n], np.int32), cells, owner, self._tick(), n_prompt)
        self.blocks.stored(seq_id, e.tokens, self._worth(e))
        return True

    def trim(self, seq_id: int, n: int) -> bool:
        """The entry's sequence holds only `n` positions (a hurried tick left the rest undone): it offers
        no more than those. True when that leaves it nothing: it is dropped, its id to release."""
        e = self.entries.get(seq_id)
        if e is None or e.cells <= n and len(e.tokens) <= n:
            return False
        self.blocks.removed(seq_id)
        if n < 1:
            del self.entries[seq_id]
            return True
        e.tokens, e.cells = e.tokens[:n], min(e.cells, n)
        self.blocks.stored(seq_id, e.tokens, self._worth(e))
        return False

    def block_hashes(self, seen_by: Hashable = None) -> set[int]:
        """The blocks the entries hold, keyed as their KV events key them (core/kvevents.py): what the
        events, replayed, add up to. With `seen_by`, only those that client could reuse: under `client`
        scope another's blocks would let it confirm a guess of someone else's prompt offline."""
        return {h for e in self.entries.values() if seen_by is None or self._mine(seen_by, e.owner)
                for h in block_hashes(e.tokens, self._worth(e))}

    def find(self, prompt: list[int], owner: Hashable, live) -> Hit | None:
        """The best reuse for a new session's prompt, or None. `live`: (seq_id, computed tokens, owner,
        prompt length) of running sessions."""
        if not self.on or len(prompt) < 2:
            return None
        p = np.asarray(prompt, np.int32)
        best: Hit | None = None
        for e in self.entries.values():
            if self._mine(owner, e.owner):
                n = self._usable(common_prefix(p, e.tokens), e.n_prompt, len(p))
                whole = n >= self._worth(e)  # nothing of value beyond what is reused: take it over
                if (n > 0 if whole else n >= MIN_SHARE) and (best is None or n > best.n):
                    best = Hit(e.seq_id, n, entry=True, takeover=whole)
        for seq_id, tokens, other, n_src_prompt in live:
            if self._mine(owner, other) and len(tokens) >= MIN_SHARE:
                n = self._usable(common_prefix(p, np.asarray(tokens, np.int32)), n_src_prompt, len(p))
                if n >= MIN_SHARE and (best is None or n > best.n):
                    best = Hit(seq_id, n, entry=False, takeover=False)
        return best

    def leader(self, prompt: list[int], owner: Hashable, running) -> tuple[object, int] | None:
        """A running session whose prompt opens like this one, to wait for and copy from: (session, n) or
        None. `running`: (session, prompt, owner) of sessions that are not waiting for a leader themselves."""
        if not self.on or len(prompt) <= MIN_SHARE:
            return None
        p, best = np.asarray(prompt, np.int32), None
        for s, other, o in running:
            if self._mine(owner, o):
                n = self._usable(common_prefix(p, np.asarray(other, np.int32)), len(other), len(p))
                if n >= MIN_SHARE and (best is None or n > best[1]):
                    best = (s, n)
        return best

    def take(self, hit: Hit) -> None:
        """The hit is used: count it; an entry taken over leaves the cache, one copied from is fresh again."""
        self.counters.hits += 1
        self.counters.hit_tokens += hit.n
        if hit.entry:
            if hit.takeover:
                del self.entries[hit.seq_id]
                self.blocks.removed(hit.seq_id)
            else:
                self.entries[hit.seq_id].used = self._tick()

    def evict(self, but: int | None = None) -> int | None:
        """Drop the least recently used entry (not `but`); its sequence id (to release), or None."""
        candidates = [e for e in self.entries.values() if e.seq_id != but]
        if not candidates:
            return None
        e = min(candidates, key=lambda e: e.used)
        del self.entries[e.seq_id]
        self.blocks.removed(e.seq_id)
        self.counters.evictions += 1
        return e.seq_id

    def forget(self, seq_id: int) -> bool:
        """The engine lost this sequence's KV (a cache miss): drop the entry without a release."""
        self.blocks.removed(seq_id)
        return self.entries.pop(seq_id, None) is not None

    def clear(self) -> list[int]:
        """Drop every entry (the engine restarted, or a refused tick made the KV's state uncertain);
        returns their sequence ids."""
        ids = list(self.entries)
        self.entries.clear()
        self.blocks.cleared()
        return ids
