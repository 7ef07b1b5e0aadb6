"""Conversations across restarts: the prefix cache's entries written to a folder at drain, read back at start.

A restarted node has an empty prefix cache, so every conversation's next turn
prefills its whole history again. With `kv_persist`, the drain's last tick saves
each cached entry's sequence (llama.cpp's per-sequence state, the same `Save` a
moving session uses), most recently used first, up to `kv_persist_mb`; each file
gets a manifest (the recipe, the tokens, whose entry it was, the file's SHA-256)
and both are written under a temporary name, synced and renamed, so a node
killed half-way leaves whole files or none. At start every manifest is checked
(JSON, recipe, size, checksum, the tokens in the state file's head) before its
file may be loaded; one that fails is skipped with one log line and removed,
never loaded. The entries that pass go back into the cache, each loaded into
its own sequence by the first tick (`Load`), and a prompt that starts the same
finds them as before. Whose they are is kept: with prefix_cache = client, an
entry is found again only by a client connecting with the same ZeroMQ routing
id (a connection's id is random unless the client sets one); with node, by
anyone.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

from ipc import seqstate

log = logging.getLogger("meshnode.front")
MANIFEST = ".json"
STATE = ".kv"


@dataclass(frozen=True)
class Kept:
    """A cache entry on disk: its state file and what it holds."""

    path: str
    tokens: list[int]
    n_prompt: int
    owner: bytes | None


class KvPersist:
    def __init__(self, folder: str, max_bytes: int, recipe: str, bytes_per_token: int):
        os.makedirs(folder, exist_ok=True)
        self.folder, self.max_bytes, self.recipe, self.bytes_per_token = folder, max_bytes, recipe, bytes_per_token

    # -- at drain ------------------------------------------------------------------------------------
    def to_save(self, entries) -> list[tuple[object, str]]:
        """(entry, temporary state file) for the entries to write, most recently used first, within the bound."""
        out, total = [], 0
        for i, e in enumerate(sorted(entries, key=lambda e: -e.used)):
            total += len(e.tokens) * self.bytes_per_token
            if total > self.max_bytes:
                break
            out.append((e, os.path.join(self.folder, f"entry-{i}{STATE}.tmp")))
        return out

    def commit(self, saving: list[tuple[object, str]], saved: dict[int, int]) -> int:
        """Give each file the engine wrote its manifest, both renamed into place; what an earlier drain left
        and this one did not write again goes. The entries written."""
        kept = set()
        for e, tmp in saving:
            if saved.get(e.seq_id, 0) <= 0:
                _remove(tmp)
                continue
            path = tmp.removesuffix(".tmp")
            with open(tmp, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            manifest = {"recipe": self.recipe, "tokens": [int(t) for t in e.tokens], "n_prompt": e.n_prompt,
                        "owner": e.owner.hex() if isinstance(e.owner, bytes) else None, "sha256": digest,
                        "bytes": saved[e.seq_id]}
            _sync_rename(tmp, path)
            _write_atomic(path.removesuffix(STATE) + MANIFEST, json.dumps(manifest).encode())
            kept |= {os.path.basename(path), os.path.basename(path.removesuffix(STATE) + MANIFEST)}
        for name in os.listdir(self.folder):
            if name not in kept:
                _remove(os.path.join(self.folder, name))
        log.info("kv_persist: %d cached conversations written to %s", len(kept) // 2, self.folder)
        return len(kept) // 2

    # -- at start ------------------------------------------------------------------------------------
    def restore(self, sched, limit: int) -> None:
        """The entries that hold up into the scheduler's prefix cache (Scheduler.restore_cache)."""
        n = sched.restore_cache(self.load(limit))
        log.info("kv_persist: %d cached conversations read back from %s", n, self.folder)

    def load(self, limit: int) -> list[Kept]:
        """The entries a drain wrote that hold up (at most `limit`, the most recently used first); the rest
        are removed, each with one line."""
        out = []
        for name in sorted(os.listdir(self.folder), key=_entry_number):
            if name.endswith(".tmp"):  # a drain that was killed half-way
                _remove(os.path.join(self.folder, name))
            if not name.endswith(MANIFEST):
                continue
            path = os.path.join(self.folder, name.removesuffix(MANIFEST) + STATE)
            kept, why = self._check(os.path.join(self.folder, name), path)
            if kept is None or len(out) >= limit:
                log.warning("kv_persist: %s skipped: %s", path, why or f"more than the {limit} entries this node holds")
                _remove(path)
                _remove(os.path.join(self.folder, name))
                continue
            out.append(kept)
        return out

    def _check(self, manifest_path: str, path: str) -> tuple[Kept | None, str]:
        try:
            with open(manifest_path, "rb") as f:
                m = json.loads(f.read())
            tokens, owner = m["tokens"], m["owner"]
            if m["recipe"] != self.recipe:
                return None, f"written by a node of another recipe ({m['recipe']}, this one {self.recipe})"
            if not (isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens)):
                return None, "its manifest holds no token list"
            with open(path, "rb") as f:
                data = f.read()
            if len(data) != m["bytes"] or hashlib.sha256(data).hexdigest() != m["sha256"]:
                return None, "its SHA-256 or size is not the one its manifest names"
            if not seqstate.holds(path, tokens):
                return None, "it holds the KV of other tokens than its manifest names"
            return Kept(path, tokens, int(m["n_prompt"]), bytes.fromhex(owner) if owner else None), ""
        except (OSError, ValueError, KeyError, TypeError) as e:
            return None, f"unreadable ({type(e).__name__}: {e})"


def _entry_number(name: str) -> int:
    digits = name.removeprefix("entry-").split(".")[0]
    return int(digits) if digits.isdigit() else 1 << 30


def _write_atomic(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    _sync_rename(path + ".tmp", path)


def _sync_rename(tmp: str, path: str) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
