"""Conversations across restarts: the prefix cache's entries written to a folder at drain, read back at start.

A restarted node has an empty prefix cache, so every conversation's next turn
prefills its whole history again. With `kv_persist`, the drain's last tick saves
each cached entry's sequence (llama.cpp's per-sequence state, the same `Save` a
moving session uses), most recently used first, up to `kv_persist_mb`; each file
gets a manifest (the recipe, the tokens, whose entry it was, the file's SHA-256)
and both are written under a temporary name, synced and renamed, so a node
killed half-way leaves whole files or none. At start every manifest is checked
(bounded in size and depth, JSON, recipe, size, checksum) and its state file
parsed whole and written anew in the node's own folder (front/moves.py
`checked`, ipc/seqstate.py): only that copy is loaded. One that fails is skipped
with one log line and removed, never loaded, and nothing in the folder stops the
start. The folder is treated as ssh treats its keys: one that is not the node's
user's or that others can write is refused at start (kv_persist off, one line),
every file is opened without following links and created new (O_EXCL), and a
temporary name is removed before the engine writes it, so a link planted there
redirects nothing. The entries that pass go back into the cache, each loaded into
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
import stat
from dataclasses import dataclass

from ipc import jsonvalue

log = logging.getLogger("meshnode.front")
MANIFEST = ".json"
STATE = ".kv"
MAX_MANIFEST_BYTES = 16 << 20  # a manifest is its tokens as JSON: well above any context's
MAX_DEPTH = 4  # a manifest is one map of flat values and one list: nothing nests deeper


@dataclass(frozen=True)
class Kept:
    """A cache entry on disk: its state file and what it holds."""

    path: str
    tokens: list[int]
    n_prompt: int
    owner: bytes | None


def folder_problem(folder: str) -> str:
    """Why a kv_persist folder may not be used (created 0700 where it is missing); "" when it may."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError as e:
        return f"kv_persist {folder}: {e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"kv_persist {folder} is not a directory (a link is not followed)"
    if st.st_uid != os.geteuid():
        return (f"kv_persist {folder} belongs to uid {st.st_uid}, not this node's {os.geteuid()}: chown it or "
                "choose another")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"kv_persist {folder} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"chmod go-w {folder}, or choose another")
    return ""


class KvPersist:
    def __init__(self, folder: str, max_bytes: int, recipe: str, bytes_per_token: int, checked):
        """`checked(path, tokens)`: a state file parsed whole and copied into the node's folder (Moves.checked).
        The folder must have passed `folder_problem`."""
        self.folder, self.max_bytes, self.recipe, self.bytes_per_token = folder, max_bytes, recipe, bytes_per_token
        self.checked = checked

    # -- at drain ------------------------------------------------------------------------------------
    def to_save(self, entries) -> list[tuple[object, str]]:
        """(entry, temporary state file) for the entries to write, most recently used first, within the bound."""
        out, total = [], 0
        for i, e in enumerate(sorted(entries, key=lambda e: -e.used)):
            total += len(e.tokens) * self.bytes_per_token
            if total > self.max_bytes:
                break
            tmp = os.path.join(self.folder, f"entry-{i}{STATE}.tmp")
            _remove(tmp)  # llama.cpp's save follows a link: none may wait at the name it writes
            out.append((e, tmp))
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
            with _open(tmp) as f:
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
        """A manifest and its state file that hold up, with the node's own copy of the file to load."""
        try:
            with _open(manifest_path, MAX_MANIFEST_BYTES) as f:
                raw = f.read()
            if jsonvalue.depth(raw) > MAX_DEPTH:
                return None, f"its manifest nests deeper than {MAX_DEPTH}"
            m = json.loads(raw)
            if not isinstance(m, dict):
                return None, "its manifest is not a JSON object"
            tokens, owner, n_prompt, size = m.get("tokens"), m.get("owner"), m.get("n_prompt"), m.get("bytes")
            if m.get("recipe") != self.recipe:
                return None, f"written by a node of another recipe ({m.get('recipe')!r}, this one {self.recipe})"
            if not (isinstance(tokens, list) and tokens and all(type(t) is int and 0 <= t < 2**31 for t in tokens)):
                return None, "its manifest holds no token list"
            if not (type(n_prompt) is int and 0 < n_prompt <= len(tokens)) or type(size) is not int:
                return None, "its manifest's n_prompt or bytes is not a count"
            if not (owner is None or isinstance(owner, str)) or not isinstance(m.get("sha256"), str):
                return None, "its manifest's owner or sha256 is not a string"
            if size > len(tokens) * self.bytes_per_token * 2 + (1 << 20):
                return None, f"its manifest names {size} bytes, more than {len(tokens)} positions take"
            with _open(path, size) as f:
                data = f.read()
            if len(data) != size or hashlib.sha256(data).hexdigest() != m["sha256"]:
                return None, "its SHA-256 or size is not the one its manifest names"
            copy, why = self.checked(path, tokens)
            if why:
                return None, why
            return Kept(copy, tokens, n_prompt, bytes.fromhex(owner) if owner else None), ""
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            return None, f"unreadable ({type(e).__name__}: {e})"


def _open(path: str, limit: int | None = None):
    """A regular file opened for reading without following a link and without blocking (a FIFO); OSError for
    anything else, or one over `limit` bytes, before a byte of it is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if limit is not None and st.st_size > limit:
            raise OSError(f"{path} is {st.st_size} bytes, more than the {limit} it may be")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise



def _entry_number(name: str) -> int:
    digits = name.removeprefix("entry-").split(".")[0]
    return int(digits) if digits.isdigit() else 1 << 30


def _write_atomic(path: str, data: bytes) -> None:
    _remove(path + ".tmp")
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    _sync_rename(path + ".tmp", path)


def _sync_rename(tmp: str, path: str) -> None:
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    """Gone if it was a file or a link (a link itself, never what it names); a folder or anything that cannot
    be removed is left, with one line."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("kv_persist: %s left in place: %s", path, e)
