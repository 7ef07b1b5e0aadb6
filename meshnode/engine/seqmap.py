"""Which llama.cpp sequence (KV stream) holds each of the front's sequences, kept packed at the bottom.

With per-sequence streams, llama.cpp's `split_equal` cuts a tick's decode rows into
one ubatch per run of consecutive sequence ids, and each ubatch is one more pass over
the weights: four decoding sequences on ids 0, 2, 4, 6 cost about 2.5x a tick on
ids 0-3 (evidence/layout-bench.json, `id_gaps`). The front hands out the lowest free
id, but sessions end in any order and leave gaps. So the engine keeps its own
mapping: a new sequence gets the lowest free stream, and when one ends, the highest
one moves down into the gap (llama.cpp copies the stream's buffers at the next
decode; the copy is exact, so deterministic mode holds across it). The front never
sees physical ids, and nothing in flight has to be renumbered.
"""
from __future__ import annotations

import bisect


class SeqMap:
    def __init__(self, n: int):
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

    def compaction(self) -> list[tuple[int, int]]:
        """Move the highest streams into the lowest gaps until the used ones are 0..k-1: the
        (from, to) stream moves to perform, in order; the mapping already reflects them."""
        moves = []
        by_phys = {p: s for s, p in self.phys.items()}
        while self.free and by_phys and self.free[0] < max(by_phys):
            src = max(by_phys)
            dst = self.free.pop(0)
            s = by_phys.pop(src)
            self.phys[s], by_phys[dst] = dst, s
            bisect.insort(self.free, src)
            moves.append((src, dst))
        return moves
