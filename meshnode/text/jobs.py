"""Tokenization on a worker thread, so no client's text can stall the tick loop.

The front's loop plans ticks and streams tokens for everyone; a text of 256 KiB
costs tens of milliseconds to tokenize even on the linear path, which the loop
must not pay. llama_tokenize is a ctypes call that releases the GIL, so the
loop runs on while the worker tokenizes. The worker wakes the loop through a
pipe the loop's poller watches. The backlog is bounded in characters: past it,
new texts are refused at once rather than queued behind minutes of work.

The worker takes turns between owners (client identities) a slice of text at a
time, so ten clients' long texts cannot make an eleventh client's `hello` wait
behind all of them: it waits for one slice of each, its own share. One owner's
texts finish in the order they came.

While sessions decode (`decoding()`), the worker's CPU is metered like the rest
of the client work (meshnode/core/cpushare.py): llama.cpp's threads spin at every
barrier, so a tokenizer taking a core stalls every stream (ten clients' 256 KiB
chat messages made 390 ms gaps in 3 ms ticks, `python -m benchmarks abuse`). An idle
node tokenizes at full speed.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from meshnode.core.cpushare import CpuShare

MAX_BACKLOG_CHARS = 8 << 20  # text waiting for the worker, all clients together


@dataclass
class TextJob:
    key: object  # the caller's handle (the front: client identity and request)
    prompt: object  # what the `slices` function given to TextJobs takes: a text or a chat prompt
    owner: Hashable = None  # whose turn it is tokenized in
    tokens: list[int] = field(default_factory=list)
    error: str = ""


class TextJobs:
    def __init__(self, slices, max_backlog_chars: int = MAX_BACKLOG_CHARS, decoding=None):
        """`slices(prompt)` yields the prompt's tokens a slice at a time (Tokenizer.prompt_slices);
        `decoding()`: whether sessions are decoding now (then the worker keeps to its CPU share)."""
        self._slices, self._decoding = slices, decoding
        self._share = CpuShare(time.monotonic())
        self.max_backlog_chars = max_backlog_chars
        self.backlog_chars = 0  # owned by the caller's thread: added in submit, removed in finished
        self.jobs_total = 0  # texts taken for tokenizing, for telemetry
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._work, name="tokenizer", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable when jobs have finished (for the caller's poller)."""
        return self._wake_r

    def submit(self, key, prompt, owner: Hashable = None) -> bool:
        """Queue a prompt; False (nothing queued) when the backlog is full."""
        size = len(prompt)
        if self.backlog_chars + size > self.max_backlog_chars:
            return False
        self.backlog_chars += size
        self.jobs_total += 1
        self._todo.put(TextJob(key, prompt, owner))
        return True

    def finished(self) -> list[TextJob]:
        """Jobs done since the last call, in the order they finished (one owner's in submission order)."""
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
            self.backlog_chars -= len(job.prompt)
            out.append(job)
        return out

    def _work(self) -> None:
        owners: dict[Hashable, deque] = {}  # owner -> its jobs, oldest first, each with its slice iterator
        turns: deque = deque()  # owners with work, in turn order
        while True:
            block = not owners
            while True:  # take what has arrived; wait only when there is nothing to do
                try:
                    job = self._todo.get(block=block)
                except queue.Empty:
                    break
                if job is None:
                    return
                if job.owner not in owners:
                    owners[job.owner] = deque()
                    turns.append(job.owner)
                owners[job.owner].append([job, None])
                block = False
            owner = turns[0]
            turns.rotate(-1)
            entry = owners[owner][0]
            job = entry[0]
            try:
                if entry[1] is None:
                    entry[1] = iter(self._slices(job.prompt))
                cpu = time.thread_time()
                job.tokens += next(entry[1])
                self._keep_to_share(time.thread_time() - cpu)
                continue
            except StopIteration:
                pass
            except ValueError as e:  # a chat its template refuses, a text llama.cpp refuses: the client's problem
                job.error = str(e)
            except Exception as e:  # noqa: BLE001 -- whatever else a prompt did, never the node's end
                job.error = f"text did not tokenize: {e}"
            owners[owner].popleft()
            if not owners[owner]:
                del owners[owner]
                turns.remove(owner)
            self._done.put(job)
            os.write(self._wake_w, b"x")

    def _keep_to_share(self, cpu_s: float) -> None:
        if self._decoding is None or not self._decoding():
            return
        now = time.monotonic()
        self._share.available(now)
        self._share.spend(cpu_s)
        wait = self._share.wait_s(now)
        if wait:
            time.sleep(wait)

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
