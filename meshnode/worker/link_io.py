"""The engine process's end of the link, worked beside the decode instead of between decodes.

Every microsecond between two llama_decode calls is time the model does not
run, so the main thread only takes the next tick from a queue and hands its
answer back; the rest runs on two threads while the next decode runs
(llama_decode releases the GIL), figures in docs/architecture.md:

- the reader receives and decodes each tick request (its tokens copied out of
  the shared arena) as soon as it arrives;
- the writer writes each tick's sampled tokens to the arena, builds its answer
  with the latest memory figures, sends it, beats the heartbeat's "finished", and
  only then re-reads psutil when the figures are older than MEMORY_EVERY_S.

Order is kept: ticks reach the main thread in arrival order and answers leave
in hand-over order, so the front sees exactly the lockstep conversation.
"""
from __future__ import annotations

import queue
import socket
import threading
import time

from ipc import link
from ipc.seqpacket import LinkSocket
from meshnode.core.types import StepResult
from meshnode.ops.memory import host_memory, rss

MEMORY_EVERY_S = 0.25
CLOSED = "link closed"  # what next() returns when the front is gone


class LinkIO:
    def __init__(self, sock: LinkSocket, arena):
        self.sock, self.arena = sock, arena
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.grammars: dict = {}  # key -> Grammar, as the front's GrammarText messages left them (reader thread only)
        self._mem = {"rss": 0, "mem_available": 0, "mem_total": 0}
        self._mem_at = -MEMORY_EVERY_S
        self.hurry = -1  # ticks up to this one are to hurry (link.Hurry), set by the reader as it arrives
        self._threads = [threading.Thread(target=self._guard, args=(self._read,), name="link-reader", daemon=True),
                         threading.Thread(target=self._guard, args=(self._write,), name="link-writer", daemon=True)]

    def start(self) -> None:
        self._refresh_memory()
        for th in self._threads:
            th.start()

    def next(self, timeout_s: float):
        """The next TickRequest, a MalformedTick (refuse it, in its place), Stop, CLOSED, or None after
        `timeout_s` with nothing. A link thread's failure (a message that is not msgpack at all: the
        front has a bug) is raised here."""
        try:
            item = self._inbox.get_nowait()  # usually there already: read while the last step ran
        except queue.Empty:
            try:
                item = self._inbox.get(timeout=timeout_s)
            except queue.Empty:
                return None
        if isinstance(item, Exception) and not isinstance(item, link.MalformedTick):
            raise item
        return item

    def queued(self) -> bool:
        """A message is waiting for the main thread (a tick the front sent behind the one running)."""
        return not self._inbox.empty()

    def done(self, tick: int, res: StepResult, gap_ms: float) -> None:
        """Hand a step over: its TickDone, with the latest memory figures, is built and sent in order.
        Built here, on the writer, not by the main thread: that runs while the next decode does, where
        the main thread's every microsecond delays it."""
        self._outbox.put((tick, res, gap_ms))

    def refuse(self, answer: link.TickRefused) -> None:
        """Hand a refusal over; it is sent in order."""
        self._outbox.put(answer)

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
                msg = link.decode(data, self.arena, self.grammars)
            except link.MalformedTick as e:
                msg = e
            if isinstance(msg, link.Hurry):  # for the ticks running and queued: the engine reads `hurry`
                self.hurry = msg.tick
                continue
            if isinstance(msg, link.GrammarText):  # for the ticks behind it: they name it by key
                self.grammars[msg.grammar.key] = msg.grammar
                for key in msg.forget:
                    self.grammars.pop(key, None)
                continue
            self._inbox.put(msg)
            if isinstance(msg, link.Stop):
                return

    def _guard(self, loop) -> None:
        """A link thread that fails hands its exception to the main thread, which raises it: the
        engine exits and the front restarts it, instead of a silent thread and a tick deadline."""
        try:
            loop()
        except Exception as e:
            self._inbox.put(e)

    def _write(self) -> None:
        while (answer := self._outbox.get()) is not None:
            if not isinstance(answer, link.TickRefused):
                tick, res, gap_ms = answer
                answer = link.TickDone(tick, res, gap_ms, **self._mem)
            try:
                self.sock.send(link.encode(answer))
            except OSError:  # the front is gone
                self._inbox.put(CLOSED)
                return
            # only now: the front never calls a finished tick hung, so "finished" must mean the answer
            # is in the socket. Beaten before the send, an engine stopped in between hung the node
            # with no deadline to end it (tests/test_stall.py, the stopped engine, failed that way once)
            self.arena.beat(answer.tick, finished=True)
            if time.monotonic() - self._mem_at >= MEMORY_EVERY_S:
                self._refresh_memory()

    def _refresh_memory(self) -> None:
        avail, total = host_memory()
        self._mem, self._mem_at = {"rss": rss(), "mem_available": avail, "mem_total": total}, time.monotonic()
