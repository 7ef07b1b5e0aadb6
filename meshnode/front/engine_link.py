"""The front's handle on the engine process: spawn, tick, detect death, restart.

Up to `depth` ticks are in flight: the front plans the next tick while the
engine runs the current one, and the engine finds it queued when it replies.
Replies come back in order. When the engine refuses a tick, the ticks queued
behind it are refused too (they were planned on top of it): their replies
are dropped here, and the next tick sent carries `resync`.

Death is any of: the process sentinel fires, the link closes or answers
with a fatal error, a tick runs past its deadline, or an incarnation does not
say hello in time (a hang: the process is killed). A hang is judged by the
engine's own heartbeat in the shared arena (ipc/shm.py), never by how long the
front took to read a reply: only a tick the engine has not finished can be
late. A restarted incarnation must say hello within a deadline derived from
how long the first one took to load the model (with a floor), so a stuck
restart costs live sessions seconds, not the first start's generous timeout. Each incarnation gets a fresh link socket (ipc/seqpacket.py) that
accepts only that process, so no message of a dead engine can be mistaken
for a live one's. Restarts back off exponentially; a crash loop (too
many deaths in a row without one good tick) marks the engine unhealthy and
stops respawning, so the node reports it instead of spinning. So does an
incarnation that loaded a different model (the file was replaced under a
running node): no session could continue on it.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import select
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

from ipc import link as L
from ipc import seqpacket
from ipc.shm import TokenArena
from meshnode.core.types import Plan
from meshnode.worker.main import engine_main

log = logging.getLogger("meshnode.front")

STARTING, IDLE, BUSY, DOWN, FAILED = "STARTING", "IDLE", "BUSY", "DOWN", "FAILED"
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 5.0
CRASH_LOOP_DEATHS = 5  # deaths in a row with no good tick between them
RESTART_FACTOR = 5  # a restart may take this many times the measured first start (page cache, load)


@dataclass
class Flight:
    """A tick sent and not answered yet."""
    t: int
    plan: Plan
    sent_at: float
    discard: bool = False  # queued behind a refused tick: the engine refuses it too


class EngineLink:
    def __init__(self, run_dir: str, engine_cfg: dict, arena: TokenArena, tick_deadline_s: float,
                 faults: list | None = None, depth: int = 2, start_timeout_s: float = 300.0,
                 restart_timeout_min_s: float = 10.0, claim=lambda path: None):
        self.run_dir, self.engine_cfg, self.arena = run_dir, engine_cfg, arena
        self.tick_deadline_s = tick_deadline_s
        self.start_timeout_s, self.restart_timeout_min_s = start_timeout_s, restart_timeout_min_s
        self.first_start_s: float | None = None  # measured: spawn to hello of the first incarnation
        self.claim = claim  # tells the front's reaper of each socket file made here
        self.faults = faults
        self.depth = depth
        self.inflight: deque[Flight] = deque()
        self.resync = False
        self.state = DOWN
        self.info: SimpleNamespace | None = None
        self.proc = None
        self.listener = None  # until the incarnation connects
        self.sock: seqpacket.LinkSocket | None = None
        self.broken = ""  # why the link failed, for check() to report
        self.generation = 0
        self.restarts = 0
        self.deaths_in_row = 0
        self.next_start_at = 0.0
        self.started_at = 0.0
        self.tick_seq = 0
        self.last_error = ""  # why the engine last died (status reports it)
        self.words = ""  # what this incarnation said about its own failure (hello_error, abort)
        self.unrecoverable = ""  # a death no restart can cure

    @property
    def path(self) -> str:
        return f"{self.run_dir}/engine-{os.getpid()}-{self.generation}.sock"

    @property
    def watch(self):
        """What the front's poller watches: the listener until the engine connects, then the link."""
        return self.sock if self.sock is not None else self.listener

    def start(self) -> None:
        """Spawn an incarnation; it connects and says hello later, through on_message()."""
        self._close_sock()
        self.generation += 1
        self.words = ""
        self.arena.reset_heartbeat()
        self.claim(self.path)
        self.listener = seqpacket.listen(self.path)
        cfg = dict(self.engine_cfg, link=self.path, parent_pid=os.getpid(),
                   arena={"name": self.arena.name, "n_input": self.arena.n_input, "n_output": self.arena.n_output})
        if self.faults:  # tests only: one entry per incarnation, the last one for all after it
            cfg["faults"] = self.faults[min(self.generation, len(self.faults)) - 1]
        self.proc = mp.get_context("spawn").Process(target=engine_main, args=(cfg,), daemon=True,
                                                   name=f"meshnode-engine-{self.generation}")
        self.proc.start()
        self.state, self.started_at = STARTING, time.monotonic()

    @property
    def hello_deadline_s(self) -> float:
        """How long an incarnation may take to say hello: the configured start timeout the first
        time, then a multiple of what the first start measured (never below the floor)."""
        if self.first_start_s is None:
            return self.start_timeout_s
        return min(self.start_timeout_s, max(self.restart_timeout_min_s, RESTART_FACTOR * self.first_start_s))

    def wait_ready(self, stop=lambda: False) -> SimpleNamespace | None:
        """Block until the first incarnation says hello (node start-up only); None if `stop()`."""
        while self.state == STARTING:
            if stop():
                return None
            if select.select([self.watch], [], [], 0.1)[0]:
                self.on_message()
            why = self.check(time.monotonic())
            if why:
                raise RuntimeError(f"engine did not start: {why}")
        return self.info

    def on_message(self) -> tuple[dict, Plan] | None:
        """Read one message: a tick's reply and the plan it answers, or None (a connection, hello,
        stale or dropped reply, or a closed link, which check() then reports)."""
        if self.sock is None:
            self.sock = seqpacket.accept(self.listener, self.pid)
            if self.sock is not None:  # connected: the path is not needed any more
                self._close_listener()
            return None
        data = self.sock.recv()
        if data is None:
            self.broken = self.broken or "engine closed the link"
            return None
        try:
            msg = L.unpack_message(data)
        except ValueError as e:  # the engine is broken: check() reports it, then the restart
            self.broken = self.broken or f"engine sent a malformed message: {e}"
            return None
        if "hello" in msg:
            info = SimpleNamespace(**msg["hello"])
            if self.info is not None and (info.recipe, info.n_vocab) != (self.info.recipe, self.info.n_vocab):
                # the file changed under a running node: sessions cannot continue on another model,
                # and the front's tokenizer, budgets and recipe all describe the old one
                self.unrecoverable = self.broken = (
                    f"the restarted engine loaded a different model (recipe {info.recipe}, this node serves "
                    f"{self.info.recipe}): {self.engine_cfg.get('engine', {}).get('model_path')} changed; "
                    "restart the node")
                return None
            self.info = info
            self.state = IDLE
            if self.first_start_s is None:
                self.first_start_s = time.monotonic() - self.started_at
            return None
        if "hello_error" in msg:
            self.words = msg["hello_error"]
            return None
        if "abort" in msg:  # its last words: the process is going down
            self.broken = self.words = f"llama.cpp aborted: {msg['abort']}"
            return None
        if not self.inflight or msg.get("t") != self.inflight[0].t:
            return None  # a stale reply from before a restart
        flight = self.inflight.popleft()
        if not self.inflight:
            self.state = IDLE
        if flight.discard:
            return None
        if msg.get("ok"):
            self.deaths_in_row = 0
        elif not msg.get("fatal"):
            for f in self.inflight:
                f.discard = True
            self.resync = True
        return msg, flight.plan

    @property
    def can_send(self) -> bool:
        return self.state in (IDLE, BUSY) and len(self.inflight) < self.depth

    def send_tick(self, plan: Plan, fresh: bool = False) -> None:
        self.tick_seq += 1
        try:
            self.sock.send(L.encode_tick(self.tick_seq, plan, self.arena, self.resync, fresh))
        except OSError as e:  # it stopped reading or is gone: check() reports it, then the restart
            self.broken = self.broken or f"engine link send failed: {e}"
        self.resync = False
        self.inflight.append(Flight(self.tick_seq, plan, time.monotonic()))
        self.state = BUSY

    def check(self, now: float) -> str | None:
        """Why the engine is dead now, or None: exited, broken, hung in a tick, or silent at start."""
        if self.state not in (STARTING, IDLE, BUSY):
            return None
        if self.broken and self.proc is not None:
            self.proc.join(0.5)  # a broken link is a process going down: let it finish, to say how
        if self.proc is not None and not self.proc.is_alive():
            self._read_last_words()
            return f"engine process exited (code {self.proc.exitcode})" + (f": {self.words}" if self.words else "")
        if self.broken:
            return self.words or self.broken
        if self.state == STARTING and now - self.started_at > self.hello_deadline_s:
            return f"engine did not say hello within {self.hello_deadline_s:.1f} s"
        return self._hung(now)

    def _read_last_words(self) -> None:
        """A dead engine may have said why (hello_error, abort) in messages still unread."""
        for _ in range(8):
            watch = self.watch
            if watch is None or not select.select([watch], [], [], 0)[0]:
                return
            self.on_message()

    def _hung(self, now: float) -> str | None:
        """A tick the engine has not finished, late by the engine's own heartbeat. A finished tick
        whose reply the front has not read yet is never late, however long the front was busy."""
        started, finished, changed = self.arena.heartbeat()
        late = next((f for f in self.inflight if f.t > finished), None)
        if late is None:
            return None
        since = max(changed, late.sent_at)  # it could not start before it got the tick
        if now - since <= self.tick_deadline_s:
            return None
        where = "in its step" if started == late.t else "without taking it"
        return f"tick {late.t} ran past its {self.tick_deadline_s:.1f} s deadline ({now - since:.1f} s {where})"

    def died(self, why: str) -> None:
        """Kill what is left and schedule a restart with backoff (or give up in a crash loop)."""
        log.error("engine died: %s", why)
        self.last_error = why
        self.kill()
        self.inflight.clear()
        self.resync = False
        self.deaths_in_row += 1
        if self.unrecoverable or self.deaths_in_row >= CRASH_LOOP_DEATHS:
            self.state = FAILED
            log.error("not restarting the engine: %s", self.unrecoverable or
                      f"crash loop, {self.deaths_in_row} deaths in a row")
            return
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.deaths_in_row - 1))
        self.state, self.next_start_at = DOWN, time.monotonic() + delay

    def maybe_restart(self, now: float) -> bool:
        if self.state == DOWN and now >= self.next_start_at:
            self.restarts += 1
            self.start()
            return True
        return False

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
            self.proc = None
        self._close_sock()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the engine to exit cleanly, then make sure it has."""
        if self.proc is not None and self.proc.is_alive() and self.sock is not None:
            try:
                self.sock.send(L.STOP)
            except OSError:
                pass
            self.proc.join(timeout)
        self.kill()
        self.state = DOWN

    def _close_sock(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._close_listener()
        self.broken = ""

    def _close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0
