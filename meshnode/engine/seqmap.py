"""Which llama.cpp sequence (KV stream) holds each of the front's sequences, the live ones kept together.

With per-sequence streams, llama.cpp's `split_equal` cuts a tick's decode rows into
one ubatch per run of consecutive sequence ids, and each ubatch is one more pass over
the weights: four decoding sequences on ids 0, 2, 4, 6 cost about 2.5x a tick on
ids 0-3 (evidence/layout-bench.json, `id_gaps`). Sessions end in any order, and the
prefix cache keeps a finished session's stream, so the sequences that decode end up
between streams that hold nothing or only cached conversations (measured: four
sessions on streams 1, 5, 6, 7 around four cached ones, 40 ms a tick against 24 on
four consecutive streams, bench model). So the engine keeps its own mapping and
keeps the live sequences (those that ran in the last few ticks) on consecutive
streams: a sequence in the way moves out to a free stream, a live one outside moves
in (llama.cpp copies the stream's buffers at the next decode; the copy is exact, so
deterministic mode holds across it). The front never sees physical ids, and nothing
in flight has to be renumbered.
"""
from __future__ import annotations

import bisect


class SeqMap:
    def __init__(self, n: int):
        self.n = n
        self.phys: dict[int, int] = {}  # front's sequence id -> llama.cpp sequence id
        self.free = list(range(n))  # sorted

    def __getitem__(self, seq_id: int) -> int:
        p = self.phys.get(seq_id)
        if p is None:
            p = self.phys[seq_id] = self.free.pop(0)
        return p

    def get(self, seq_id: int) -> int | None:
        return self.phys.get(seq_id)

    def drop(self, seq_id: int) -> int | None:
        """Forget `seq_id`; returns the stream it held (to clear), if any."""
        p = self.phys.pop(seq_id, None)
        if p is not None:
            bisect.insort(self.free, p)
        return p

    def arrange(self, live: list[int]) -> list[tuple[int, int]]:
        """Put the `live` sequences on consecutive streams, the ones not mapped yet included: the
        (from, to) stream moves to perform, in order; the mapping already reflects them. The block
        chosen needs the fewest moves (the lowest of those); a sequence in it that is not live moves
        out to a free stream first. Nothing moves where the live ones are together already (nearly
        every tick), nor where no block can be cleared (no free stream to move a cached one into)."""
        mapped = [self.phys[s] for s in live if s in self.phys]
        if len(mapped) == len(live) and (not mapped or max(mapped) - min(mapped) + 1 == len(mapped)):
            return []
        k, want, used = len(live), set(live), {p: s for s, p in self.phys.items()}
        best = None
        for b in range(self.n - k + 1):
            idle_in = [p for p in range(b, b + k) if p in used and used[p] not in want]
            outside = [s for s in live if s in self.phys and not b <= self.phys[s] < b + k]
            free_out = [p for p in self.free if not b <= p < b + k]
            if len(idle_in) <= len(free_out) and (best is None or len(idle_in) + len(outside) < best[0]):
                best = (len(idle_in) + len(outside), b, idle_in, outside, free_out)
        if best is None:
            return []
        _, b, idle_in, outside, free_out = best
        moves = []

        def move(s: int, dst: int) -> None:
            if s in self.phys:
                moves.append((self.phys[s], dst))
                bisect.insort(self.free, self.phys[s])
            self.free.remove(dst)
            self.phys[s] = dst

        for p, dst in zip(idle_in, free_out):
            move(used[p], dst)
        for s in outside + [s for s in live if s not in self.phys]:
            move(s, next(p for p in self.free if b <= p < b + k))
        return moves
