"""The model's chat template run in a child process of its own, with a time and a memory bound.

A template is the model file's code. In the node's process, the sandbox (meshnode/text/jinja.py) bounds its
powers, repetitions and CPU time, but not what it allocates: a filter (`center`, `indent`, `join`) or a
string doubled in a loop makes gigabytes in a few hundred milliseconds, and a process's memory cannot be
bounded per thread. Here it runs in `python -m meshnode.text.templatehost` under RLIMIT_AS, so a render
that allocates past MAX_MEMORY gets MemoryError (that request's refusal), one that outlives HARD_WALL_S is
killed, and the next render starts a fresh child. The caller (the tokenizer's worker thread) waits on a pipe
with the GIL released, so the front's loop answers pings throughout.

Frames are a 4-byte length and msgpack: `["load", source, bos, eos, add_bos, add_eos]` once, then
`["render", messages, tools, opened, today]`, each answered `[True, text]` or `[False, why]`.
"""
from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
import threading
import time

import msgpack

from meshnode.text import jinja
from meshnode.text.jinja import MAX_RENDER_WALL_S, TemplateError

MAX_MEMORY = 512 << 20  # what a render may allocate past the child's own start (real templates: under 1 MiB)
MAX_TEXT = 32 << 20  # the longest rendered text a render returns (the tokenizer's whole backlog is 8 M)
HARD_WALL_S = 4 * MAX_RENDER_WALL_S  # past the template's own watchdog: the child is stuck in C; kill it
# the child's CPU priority below the engine's threads: they spin at every barrier, so a template burning a core
# for its CPU bound doubled a stream's gaps on 2 cores (p50 45 -> 90 ms, worst 504 ms); nice 19 kept them flat
# but added 60 ms to every honest chat's first token; 10 keeps both (evidence/hostile-templates.txt)
NICE = 10
START_S = 60.0  # a child's start (an interpreter and jinja2; a busy machine takes seconds)


def _frame(obj) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("<I", len(data)) + data


class TemplateHost:
    """One template's child process, started at the first render and again after one that killed it."""

    def __init__(self, source: str, bos: str, eos: str, add_bos: bool, add_eos: bool):
        self._load = ["load", source, bos, eos, add_bos, add_eos]
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # the tokenizer's worker renders; the front's probe before the ready line
        self.restarts = 0  # children that were killed or died (a hostile template's count)

    def render(self, messages: list[dict], tools: list | None = None, opened: bool = True) -> str:
        """The template over the messages (ChatTemplate.render's answer), or TemplateError with why."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is not None:  # died between renders: no one's fault
                self._kill()
            if self._proc is None:
                self._start()
            ok, value = self._ask(["render", messages, tools, opened, jinja.now().isoformat()], HARD_WALL_S)
        if not ok:
            raise TemplateError(value)
        return value

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "meshnode.text.templatehost"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        ok, why = self._ask(self._load, START_S)
        if not ok:
            self._kill()
            raise TemplateError(why)

    def _ask(self, request: list, limit_s: float) -> tuple[bool, str]:
        """One request and its answer; a child that dies or outlives `limit_s` is killed (the next render starts
        another) and the request gets why."""
        try:
            self._proc.stdin.write(_frame(request))
            self._proc.stdin.flush()
            head = self._read(4, limit_s)
            (n,) = struct.unpack("<I", head)
            ok, value = msgpack.unpackb(self._read(n, limit_s), raw=False)
            return bool(ok), str(value)
        except (OSError, ValueError, TimeoutError, msgpack.UnpackException) as e:
            self._kill()
            what = f"ran past {limit_s:.0f} s" if isinstance(e, TimeoutError) else "ended its process"
            return False, f"the model's chat template {what} (its renderer is restarted for the next request)"

    def _read(self, n: int, limit_s: float) -> bytes:
        out, deadline, fd = b"", time.monotonic() + limit_s, self._proc.stdout.fileno()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise OSError("the renderer exited")
            out += chunk
        return out

    def _kill(self, died: bool = True) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            self._proc = None
            self.restarts += died

    def close(self) -> None:
        with self._lock:
            self._kill(died=False)


def _serve() -> None:
    """The child: answers requests on stdin until it closes, under the memory bound."""
    import resource
    from datetime import datetime

    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + MAX_MEMORY, vm + MAX_MEMORY))
    os.nice(NICE)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    template = None
    while True:
        head = inp.read(4)
        if len(head) < 4:
            return
        op, *args = msgpack.unpackb(inp.read(struct.unpack("<I", head)[0]), raw=False)
        try:
            if op == "load":
                template = jinja.ChatTemplate(*args)
                answer = [True, ""]
            else:
                messages, tools, opened, today = args
                jinja.now = (lambda t: lambda: t)(datetime.fromisoformat(today))
                text = template.render(messages, tools, opened)
                answer = [True, text] if len(text) <= MAX_TEXT else \
                    [False, f"the model's chat template wrote {len(text)} characters (at most {MAX_TEXT})"]
        except TemplateError as e:
            answer = [False, str(e)]
        except MemoryError:
            answer = [False, f"the model's chat template ran out of its {MAX_MEMORY >> 20} MiB"]
        except Exception as e:  # noqa: BLE001 -- the model file's code, in a process that exists to take it
            answer = [False, f"the model's chat template failed: {type(e).__name__}: {e}"]
        out.write(_frame(answer))
        out.flush()


if __name__ == "__main__":
    _serve()
