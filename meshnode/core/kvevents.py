"""The prefix cache as a prefix-aware router sees it: blocks of BLOCK_TOKENS tokens, keyed by a chained hash.

NVIDIA Dynamo and llm-d route a prompt to the node that already holds the KV of
its longest prefix; they learn what each node holds from KV events (vLLM's:
BlockStored, BlockRemoved, AllBlocksCleared). The node's cache keeps whole
sequences, not blocks, so this module is the block view of it: a cached entry
holds the blocks of its reusable tokens (all but the last token; in
deterministic mode only a long prompt's own cells, prefix.py `_worth`), and a
block is announced once while any entry holds it (entries that share a system
prompt share its blocks: refcounts, so the set a router rebuilds from the events
is exactly the set held).

The key a router computes from a prompt, so that it needs no tokenizer call of
ours (docs/operating.md, "Routers"): the prompt's token ids cut into blocks of
BLOCK_TOKENS (a partial last block is never announced), and for block i
    h_i = first 8 bytes, read as a little-endian signed 64-bit integer, of
          sha256(h_{i-1} as 8 bytes little-endian || block i's ids as int32 little-endian)
with h_{-1} = 0 (signed: Dynamo's router keys blocks by i64, and an unsigned hash
past 2^63 overflowed it). A prompt whose first block's hash is held gets a cache hit
(MIN_SHARE = BLOCK_TOKENS tokens is the least the cache reuses), as long as it
comes from a client the cache's scope lets reuse it.
"""
from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np

BLOCK_TOKENS = 16
# vLLM's field: which cache tier holds the blocks. This node has one tier, its primary cache, which routers
# credit when no tier is named (Dynamo gave blocks announced as "cpu" no overlap credit: notes/dynamo.md)
MEDIUM = None


def block_hashes(tokens, n_tokens: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of `tokens[:n_tokens]`."""
    ids = np.asarray(tokens if n_tokens is None else tokens[:n_tokens], dtype="<i4")
    out, parent = [], 0
    for i in range(len(ids) // BLOCK_TOKENS):
        block = ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS].tobytes()
        digest = hashlib.sha256(parent.to_bytes(8, "little", signed=True) + block).digest()
        parent = int.from_bytes(digest[:8], "little", signed=True)
        out.append(parent)
    return out


class BlockIndex:
    """The events that say which blocks the cache holds, in vLLM's shapes (tagged lists: what msgspec's
    `array_like, tag=True` structs encode to), for a publisher to take (`--kv-events`); off, it keeps
    nothing (the status answer derives the blocks from the entries: PrefixCache.block_hashes)."""

    def __init__(self, on: bool):
        self.on = on
        self.held: Counter = Counter()  # hash -> entries holding it
        self.by_entry: dict[int, list[int]] = {}  # seq_id -> its block hashes
        self.events: list[list] = []  # not published yet

    def stored(self, seq_id: int, tokens, n_tokens: int) -> None:
        if not self.on:
            return
        self.removed(seq_id)  # (a sequence is stored again only after it left the cache; this keeps it so)
        hashes = block_hashes(tokens, n_tokens)
        self.by_entry[seq_id] = hashes
        first = next((i for i, h in enumerate(hashes) if self.held[h] == 0), None)  # the rest are new too: chained
        for h in hashes:
            self.held[h] += 1
        if first is not None:  # a chain is announced from its first new block, with its parent's hash
            ids = np.asarray(tokens[first * BLOCK_TOKENS:len(hashes) * BLOCK_TOKENS]).tolist()
            self.events.append(["BlockStored", hashes[first:], hashes[first - 1] if first else None, ids,
                                BLOCK_TOKENS, None, MEDIUM])

    def removed(self, seq_id: int) -> None:
        hashes = self.by_entry.pop(seq_id, None)
        if not hashes:
            return
        gone = []
        for h in hashes:
            self.held[h] -= 1
            if self.held[h] == 0:
                del self.held[h]
                gone.append(h)
        if gone:
            self.events.append(["BlockRemoved", gone, MEDIUM])

    def cleared(self) -> None:
        if self.held or self.by_entry:
            self.events.append(["AllBlocksCleared"])
        self.held.clear()
        self.by_entry.clear()

    def take_events(self) -> list[list]:
        out, self.events = self.events, []
        return out
