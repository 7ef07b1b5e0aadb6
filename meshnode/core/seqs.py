"""Sequence ids and the KV they hold: which id a session gets, what it reuses, what is released when.

The scheduler decides *when* a session starts and ends; this decides *where* its
KV lives. An id is free, held by a running session, or held by a cached entry of
the prefix cache (meshnode/core/prefix.py), never two of these. A starting session
takes the lowest free id, or reuses KV: it takes a cached entry's id over (`Keep`),
copies a prefix into its own (`Share`), or waits for a running session that is
still computing the same opening (a *leader*) and copies from it once computed.
The operations decided between two plans go out with the next one, in order
(`take`), so the engine applies them before that tick's chunks.
"""
from __future__ import annotations

import bisect

from meshnode.core import moves
from meshnode.core.prefix import MIN_SHARE, Hit, PrefixCache
from meshnode.core.session import RUNNING, Session
from meshnode.core.types import Keep, Load, Release, Save, Share


class Sequences:
    def __init__(self, n_seq_max: int, prefix_cache: str = "off", deterministic: bool = False, pool_cells: int = 0,
                 kv_events: bool = False):
        """`pool_cells`: the KV cells all sequences share (a unified KV), which reserved and cached KV
        must fit together; 0 when each sequence has its own stream. `kv_events`: the cache's blocks told to
        routers (core/kvevents.py)."""
        self.free = list(range(n_seq_max))  # sorted: the lowest free id goes first
        self.cache, self.pool_cells = PrefixCache(prefix_cache, deterministic, kv_events), pool_cells
        self.to_release: list[int] = []  # ids whose KV the next plan drops
        self.kv_ops: list = []  # evictions and reuses decided for the next plan, in order
        self.reused: list[Session] = []  # sessions whose Keep or Share rides the next plan

    @property
    def available(self) -> bool:
        """An id can be had now (free, or by evicting a cached entry)."""
        return bool(self.free or self.cache.entries)

    def take(self) -> tuple[list[int], list, list[Session]]:
        """What the next plan carries: the releases, the KV operations, the sessions reusing KV."""
        out = (self.to_release, self.kv_ops, self.reused)
        self.to_release, self.kv_ops, self.reused = [], [], []
        return out

    def place(self, s: Session, running: list[Session]) -> None:
        """Give a starting session its id and whatever KV it can reuse (or a leader to wait for)."""
        if s.kv_import:  # it arrived with its KV (core/moves.py)
            s.leader, s.seq_id = None, self._free_id()
            op = moves.load(s, s.seq_id)
            if op:
                self.kv_ops.append(op)
                s.n_planned = s.n_reused = op.n
                self.reused.append(s)
            return
        hit = lead = None
        if self.cache.on and not s.embed:  # an embedding pools every row of its prompt: none may be reused
            live = [(r.seq_id, r.tokens[:min(r.n_planned, len(r.tokens))], r.owner, len(r.prompt))
                    for r in running if r.n_planned >= MIN_SHARE]
            hit = self.cache.find(s.prompt, s.owner, live)
            lead = self.cache.leader(s.prompt, s.owner, [(r, r.prompt, r.owner) for r in running if not r.leader])
            if lead and hit and lead[1] <= hit.n:
                lead = None  # what is computed already covers it
            elif lead:
                hit = None  # a running prompt is still computing more of this opening: wait, copy it once
        seq_id = None if hit and hit.takeover else self._free_id(keep=hit.seq_id if hit and hit.entry else None)
        if seq_id is None and hit:  # the hit's own sequence is the only room: take it over
            hit = Hit(hit.seq_id, hit.n, entry=True, takeover=True)
        if hit:
            self.cache.take(hit)
            if hit.takeover:
                seq_id = hit.seq_id
                self.kv_ops.append(Keep(seq_id, hit.n))
            else:
                self.kv_ops.append(Share(hit.seq_id, seq_id, hit.n))
            s.n_planned = s.n_reused = hit.n
            self.reused.append(s)
        s.leader, s.seq_id = lead, seq_id

    def save_entries(self, saving: list) -> None:
        """The next plan writes these cached entries' KV ((entry, path) pairs: front/persist.py)."""
        self.kv_ops += [Save(e.seq_id, len(e.tokens), path) for e, path in saving]

    def restore(self, kept: list) -> int:
        """Cached entries read back from files (front/persist.py): each takes a free id, which the next plan
        loads (a file the engine cannot load is a miss: the entry is dropped). How many fit."""
        n = 0
        for k in kept:
            if not self.free:
                break
            seq_id = self.free.pop(0)
            self.kv_ops.append(Load(seq_id, len(k.tokens), k.path))
            self.cache.store(seq_id, k.tokens, len(k.tokens), k.owner, k.n_prompt)
            n += 1
        return n

    def fit(self, reserved_cells: int) -> None:
        """On a unified pool, evict cached entries until they fit beside the cells reserved."""
        keep = self.cached_beside(reserved_cells)
        while self.cache.cells > keep:
            self.release(self.cache.evict())

    def cached_beside(self, reserved_cells: int) -> int:
        """The cached cells `fit(reserved_cells)` would leave (least recently used evicted first), evicting
        nothing: what a unified pool holds besides the live sequences once a session about to start reserves."""
        left = self.cache.cells
        for e in sorted(self.cache.entries.values(), key=lambda e: e.used):
            if not self.pool_cells or reserved_cells + left <= self.pool_cells:
                break
            left -= e.cells
        return left

    def follow(self, s: Session) -> None:
        """A session waiting for its leader: copy the leader's prefix once the ticks before this one
        compute it (the copy runs before this tick's chunks), or compute its own if the leader is gone."""
        leader, n = s.leader
        if leader.state != RUNNING:
            s.leader = None
        elif leader.n_planned >= n:
            s.leader = None
            self.cache.take(Hit(leader.seq_id, n, entry=False, takeover=False))
            self.kv_ops.append(Share(leader.seq_id, s.seq_id, n))
            s.n_planned = s.n_reused = n
            self.reused.append(s)

    def finished(self, s: Session, keep: bool) -> None:
        """A running session ended: its KV stays in the cache (if `keep` and the cache takes it) or goes."""
        if not (keep and self.cache.store(s.seq_id, s.tokens, s.n_planned, s.owner, len(s.prompt))):
            self.to_release.append(s.seq_id)
            bisect.insort(self.free, s.seq_id)

    def undone(self, seq_id: int, n: int) -> None:
        """A hurried tick answered after its chunk's session ended left that chunk undone: the sequence holds
        only the `n` positions before it, so its cached entry offers no more; one left with none is released."""
        if self.cache.trim(seq_id, n):
            self.release(seq_id)

    def release(self, seq_id: int) -> None:
        """Drop a cached entry's KV with the next plan; its id is free."""
        self.kv_ops.append(Release(seq_id))
        bisect.insort(self.free, seq_id)

    def lost(self, seq_id: int) -> None:
        """The engine lost this id's KV (a cache miss): a cached entry's id is free again, no release needed."""
        if self.cache.forget(seq_id):
            bisect.insort(self.free, seq_id)

    def drop_cache(self) -> list[int]:
        """Forget every cached entry (its KV is gone or uncertain); returns their ids, now free."""
        ids = self.cache.clear()
        for seq_id in ids:
            bisect.insort(self.free, seq_id)
        return ids

    def refused(self, release: list[int]) -> None:
        """Refused ticks' `release` did not run (Scheduler.refused says why it goes out again), and what they
        did to cached entries is unknown: both go out first with the next plan."""
        self.to_release = release + self.drop_cache() + self.to_release

    def restarted(self) -> None:
        """The engine's KV is gone: nothing to release, nothing cached."""
        self.to_release, self.kv_ops, self.reused = [], [], []
        self.drop_cache()

    def _free_id(self, keep: int | None = None) -> int | None:
        """The lowest free id, evicting the least recently used cached one (but `keep`) if none is."""
        if not self.free:
            seq_id = self.cache.evict(but=keep)
            if seq_id is None:
                return None
            self.kv_ops.append(Release(seq_id))
            return seq_id
        return self.free.pop(0)

    @property
    def cells(self) -> int:
        return self.cache.cells
