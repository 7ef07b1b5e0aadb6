"""Removes what the front leaves behind if it is killed: one small forked process, whatever else is alive.

A SIGKILLed front runs no cleanup, and its engine may be gone too (after a
crash loop, or killed with it), so the cleanup cannot live in either. At start,
before any thread exists, the front forks this reaper; as it creates files
(sockets, locks, the shared arena, engine-link sockets, the folder of moving sessions' KV) it tells the reaper
their paths over a pipe, and on a clean exit it says "done". When the pipe
closes without "done", the front died: the reaper removes every path it was
told of (only those: never another node's), then exits. It holds no lock and
no descriptor but its end of the pipe.
"""
from __future__ import annotations

import os
import shutil
import signal

_DONE = b"\0done\n"


class Reaper:
    def __init__(self):
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the reaper
            os.close(w)
            _reap(r)
        os.close(r)
        self._w = w

    def claim(self, path: str) -> None:
        """`path` is the front's now: remove it if the front dies without cleaning up."""
        if self._w is not None:
            os.write(self._w, path.encode() + b"\n")

    def done(self) -> None:
        """The front cleaned up after itself: nothing left to remove."""
        if self._w is not None:
            os.write(self._w, _DONE)
            os.close(self._w)
            self._w = None
            os.waitpid(self.pid, 0)


def _reap(r: int) -> None:
    """The reaper's whole life. Never returns."""
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the front's signals are not ours
            signal.signal(sig, signal.SIG_IGN)
        os.closerange(0, r)
        os.closerange(r + 1, 1 << 16)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        if not data.endswith(_DONE):
            for path in data.decode(errors="replace").splitlines():
                try:
                    if os.path.isdir(path) and not os.path.islink(path):  # a folder of the front's own files
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.unlink(path)
                except OSError:
                    pass
    finally:
        os._exit(0)
