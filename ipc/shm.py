"""The shared-memory token arena between the front and the engine process.

A tick's prompt token ids travel here as int32, not through msgpack: the front
writes every chunk's tokens into `input` (ipc/link.py says which half a tick
uses). The sampled ids, a few per tick, come back inside the tick's answer
(`python -m benchmarks samples`: cheaper there than a second region).

The segment also holds the engine's heartbeat: the tick it last started and
finished and when (CLOCK_MONOTONIC, the same clock in every process). The
engine is the one that knows whether it is mid-decode, so the front judges a
hang by it: a reply that waits unread while the front was busy is progress,
not a hung engine.

Ownership: only the creator (the front) unlinks. An attaching process must not
let Python's resource tracker unlink the segment when it exits (cpython
gh-82300), so it unregisters right after attaching. Segment names carry the
creator's pid, so a crashed run's leftovers are found and removed at start.
"""
from __future__ import annotations

import os
import re
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

PREFIX = "meshnode"
_NAME = re.compile(rf"^{PREFIX}_(\d+)_[0-9a-f]+$")


_BEAT = 3  # int64s: started tick, finished tick, monotonic ns of the last change


class TokenArena:
    def __init__(self, shm: shared_memory.SharedMemory, n_input: int, owner: bool):
        self.shm, self.owner, self.n_input = shm, owner, n_input
        self._beat = np.ndarray((_BEAT,), dtype=np.int64, buffer=shm.buf)
        self.input = np.ndarray((n_input,), dtype=np.int32, buffer=shm.buf, offset=8 * _BEAT)

    def beat(self, t: int, finished: bool) -> None:
        """The engine's side: tick `t` starts (or has finished) now. The time is written first, so a
        reader that sees the new tick sees its time too (x86 keeps stores in order)."""
        self._beat[2] = time.monotonic_ns()
        self._beat[1 if finished else 0] = t

    def heartbeat(self) -> tuple[int, int, float]:
        """The front's side: (last tick started, last tick finished, when either last changed, in
        time.monotonic() seconds)."""
        started, finished, ns = (int(x) for x in self._beat)
        return started, finished, ns / 1e9

    def reset_heartbeat(self) -> None:
        """Before a new engine incarnation: nothing started, nothing finished."""
        self._beat[:] = 0

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, n_input: int) -> "TokenArena":
        name = f"{PREFIX}_{os.getpid()}_{os.urandom(4).hex()}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=8 * _BEAT + 4 * n_input)
        return cls(shm, n_input, owner=True)

    @classmethod
    def attach(cls, name: str, n_input: int) -> "TokenArena":
        shm = _attach_untracked(name)
        if shm.size < 8 * _BEAT + 4 * n_input:
            shm.close()
            raise ValueError(f"shared memory {name} is smaller than the arena it should hold")
        return cls(shm, n_input, owner=False)

    def close(self) -> None:
        """Drop the numpy views before closing (a live view makes close() fail); unlink if ours."""
        self.input = self._beat = None  # type: ignore[assignment]
        try:
            self.shm.close()
        except BufferError:
            return
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach without registering with a resource tracker (gh-82300).

    3.13+ has track=False. Before that, registering is suppressed during the
    attach: unregistering afterwards is not enough, because a spawned child
    shares its parent's tracker and would remove the creator's registration.
    """
    try:
        return shared_memory.SharedMemory(name=name, create=False, track=False)  # type: ignore[call-arg]
    except TypeError:
        pass
    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None  # type: ignore[assignment]
    try:
        return shared_memory.SharedMemory(name=name, create=False)
    finally:
        resource_tracker.register = register  # type: ignore[assignment]


def clean_stale(shm_dir: str = "/dev/shm") -> list[str]:
    """Remove arenas whose creating process no longer exists; returns their names."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for n in names:
        m = _NAME.match(n)
        if not m:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and not alive(pid):
            try:
                os.unlink(os.path.join(shm_dir, n))
                removed.append(n)
            except OSError:
                pass
    return removed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover_segments(pid: int | None = None, shm_dir: str = "/dev/shm") -> list[str]:
    """Arena segments present now, only those of the front `pid` when given (tests assert none survive
    a node, whatever other nodes run on the machine)."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if _NAME.match(n)
                      and (pid is None or _NAME.match(n).group(1) == str(pid)))
    except OSError:
        return []
