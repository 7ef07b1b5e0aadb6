"""The engine process's end of the link, worked beside the decode instead of between decodes.

Every microsecond between two llama_decode calls is time the model does not
run. Measured on the bench model (2 cores), the link work that used to sit
there cost about 330 us a tick: with caches cold after a 65 ms decode, even
msgpack and a few Python calls are slow. So the main thread only takes the
next plan from a queue and hands its result back; the rest runs on two
threads while the next decode runs (llama_decode releases the GIL):

- the reader receives, unpacks and decodes each tick descriptor (its tokens
  copied out of the shared arena) as soon as it arrives;
- the writer writes each tick's sampled tokens to the arena, adds the latest
  memory figures to its reply, packs and sends it, and only then re-reads
  psutil (about 0.7 ms) when the figures are older than MEMORY_EVERY_S.

Order is kept: ticks reach the main thread in arrival order and replies leave
in hand-over order, so the front sees exactly the lockstep conversation.
"""
from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass

from ipc import link as L
from ipc.protocol import pack
from ipc.seqpacket import LinkSocket
from meshnode.core.types import Plan
from meshnode.ops.memory import host_memory, rss

MEMORY_EVERY_S = 0.25
STOP, CLOSED = "stop", "closed"  # what next() returns besides ticks: asked to stop, link gone


@dataclass
class Tick:
    t: object
    plan: Plan | None
    out: int = 0
    resync: bool = False
    fresh: bool = False  # the engine was idle: new work, not the answer to its last reply
    error: str = ""  # a tick whose fields do not decode; the main thread refuses it, in order


class LinkIO:
    def __init__(self, sock: LinkSocket, arena):
        self.sock, self.arena = sock, arena
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._mem: dict = {}
        self._mem_at = -MEMORY_EVERY_S
        self._threads = [threading.Thread(target=self._guard, args=(self._read,), name="link-reader", daemon=True),
                         threading.Thread(target=self._guard, args=(self._write,), name="link-writer", daemon=True)]

    def start(self) -> None:
        self._refresh_memory()
        for th in self._threads:
            th.start()

    def next(self, timeout_s: float) -> Tick | str | None:
        """The next tick, STOP, CLOSED, or None after `timeout_s` with nothing. A link thread's
        failure (a message that is not msgpack at all: the front has a bug) is raised here."""
        try:
            item = self._inbox.get_nowait()  # usually there already: read while the last step ran
        except queue.Empty:
            try:
                item = self._inbox.get(timeout=timeout_s)
            except queue.Empty:
                return None
        if isinstance(item, Exception):
            raise item
        return item

    def reply(self, msg: dict, samples: tuple | None = None) -> None:
        """Hand a reply over; it is sent in order, with the latest memory figures added, after
        `samples` (write_samples' arguments after the arena) are written to the arena."""
        self._outbox.put((msg, samples))

    def close(self) -> None:
        """Send what was handed over, then end both threads (shutting the socket wakes the reader)."""
        self._outbox.put(None)
        self._threads[1].join(timeout=1.0)
        try:
            self.sock.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._threads[0].join(timeout=1.0)

    def _read(self) -> None:
        while True:
            data = self.sock.recv()
            if data is None:
                self._inbox.put(CLOSED)
                return
            try:
                msg = L.unpack_message(data)
            except ValueError as e:
                raise ValueError(f"malformed engine-link message: {e}") from None
            if msg.get("stop"):
                self._inbox.put(STOP)
                return
            self._inbox.put(self._decode(msg))

    def _guard(self, loop) -> None:
        """A link thread that fails hands its exception to the main thread, which raises it: the
        engine exits and the front restarts it, instead of a silent thread and a tick deadline."""
        try:
            loop()
        except Exception as e:
            self._inbox.put(e)

    def _decode(self, msg: dict) -> Tick:
        try:
            plan, out, resync = L.decode_tick(msg, self.arena)
        except ValueError as e:
            return Tick(msg.get("t"), None, error=str(e))
        return Tick(msg.get("t"), plan, out, resync, bool(msg.get("fresh")))

    def _write(self) -> None:
        while (item := self._outbox.get()) is not None:
            msg, samples = item
            if samples is not None:
                L.write_samples(self.arena, *samples)
            try:
                self.sock.send(pack({**msg, **self._mem}))
            except OSError:  # the front is gone
                self._inbox.put(CLOSED)
                return
            if time.monotonic() - self._mem_at >= MEMORY_EVERY_S:
                self._refresh_memory()

    def _refresh_memory(self) -> None:
        avail, total = host_memory()
        self._mem, self._mem_at = {"rss": rss(), "mem": [avail, total]}, time.monotonic()
