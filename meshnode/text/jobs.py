"""Tokenization on a worker thread, so no client's text can stall the tick loop.

The front's loop plans ticks and streams tokens for everyone; a text of 256 KiB
costs tens of milliseconds to tokenize even on the linear path, which the loop
must not pay. llama_tokenize is a ctypes call that releases the GIL, so the
loop runs on while the worker tokenizes. The worker wakes the loop through a
pipe the loop's poller watches. The backlog is bounded in bytes: past it, new
texts are refused at once rather than queued behind minutes of work.
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass

MAX_BACKLOG_BYTES = 8 << 20  # text waiting for the worker, all clients together


@dataclass
class TextJob:
    key: object  # the caller's handle (the front: client identity and request)
    text: str
    special: bool = False  # parse special-token text (a chat template's markers) as those tokens
    tokens: list[int] | None = None
    error: str = ""


class TextJobs:
    def __init__(self, encode, max_backlog_bytes: int = MAX_BACKLOG_BYTES):
        self._encode = encode
        self.max_backlog_bytes = max_backlog_bytes
        self.backlog_bytes = 0  # owned by the caller's thread: added in submit, removed in finished
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._work, name="tokenizer", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable when jobs have finished (for the caller's poller)."""
        return self._wake_r

    def submit(self, key, text: str, special: bool = False) -> bool:
        """Queue a text; False (nothing queued) when the backlog is full."""
        size = len(text)
        if self.backlog_bytes + size > self.max_backlog_bytes:
            return False
        self.backlog_bytes += size
        self._todo.put(TextJob(key, text, special))
        return True

    def finished(self) -> list[TextJob]:
        """Jobs done since the last call, in submission order."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                break
            self.backlog_bytes -= len(job.text)
            out.append(job)
        return out

    def _work(self) -> None:
        while (job := self._todo.get()) is not None:
            try:
                job.tokens = self._encode(job.text, special=job.special)
            except Exception as e:  # a text llama.cpp refuses is the client's problem, not the node's
                job.error = f"text did not tokenize: {e}"
            self._done.put(job)
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
