"""The front's handle on the engine process: spawn, send ticks, turn answers into typed outcomes.

Each incarnation gets a fresh link socket (ipc/seqpacket.py) that accepts only
that process, so no message of a dead engine can be mistaken for a live one's.
What goes over it is typed (ipc/link.py); a tick's answer is handed to the
tick driver (front/ticks.py, the owner of the ticks in flight) as the typed
message it is. Whatever breaks the engine (a closed link, garbage, a fatal
error, an exit, a hang) is answered in one place, `why_dead()`, which the loop
asks every turn; when a silence counts as a hang and whether to restart are
meshnode/core/health.py's, and this file only does the process and socket work
those decide about.
"""
from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import select
import time
from dataclasses import replace

from ipc import link, seqpacket
from ipc.transport import rpc_hello
from ipc.shm import TokenArena
from meshnode.core.health import DOWN, READY, STARTING, EngineHealth, model_problem
from meshnode.core.pipeline import Tick
from meshnode.core.types import EngineInfo

log = logging.getLogger("meshnode.front")
LIVENESS_EVERY_S = 0.02  # how often the process itself is checked, besides its link closing
EXIT_WAIT_S = 0.5  # an engine that closed its link is exiting: how long to wait for its exit status
KILL_WAIT_S = 5.0  # a killed or stopped engine is reaped within this (a page-in of GBs of weights can be slow)
LAST_WORDS = 8  # messages still read from a dead engine's link for why it died (hello failed, abort)
START_POLL_S = 0.1  # while the node waits for the first hello: how often a stop signal is noticed


ENGINE_MODULE = "meshnode.worker.main"  # the engine process's code, found by name in the child only


def engine_process(cfg: link.EngineProcessConfig) -> None:
    """Spawn target: the engine process's main, imported in the child by module path, so the front
    never imports the worker (its layer sits beside the front's, not under it)."""
    importlib.import_module(ENGINE_MODULE).engine_main(cfg)


class EngineLink:
    def __init__(self, run_dir: str, arena: TokenArena, health: EngineHealth, *,
                 engine, n_vocab: int, model_path: str, log_level: str, rpc_timeout_s: float,
                 factory: str = "", factory_args: dict | None = None, claim=lambda path: None):
        self.run_dir, self.arena, self.health = run_dir, arena, health
        self.engine, self.log_level = engine, log_level  # engine: its EngineConfig
        self.n_vocab, self.model_path = n_vocab, model_path
        self.factory, self.factory_args = factory, factory_args  # the node's engine_factory ("": llama.cpp's)
        self.claim = claim  # tells the front's reaper of each socket file made here
        self.rpc_timeout_s = rpc_timeout_s  # each rpc worker's hello, probed while no engine holds it
        self.info: EngineInfo | None = None  # the first incarnation's: every later one must match it
        self.proc = None
        self.listener = None  # until the incarnation connects
        self.sock: seqpacket.LinkSocket | None = None
        self.generation = 0
        self.broken = ""  # why this incarnation cannot go on, for why_dead() to report
        self.going_down = False  # it closed the link or aborted: wait a moment for its exit status
        self._next_liveness = 0.0
        self.words = ""  # what this incarnation said about its own failure (hello failed, abort)
        self.grammars = link.GrammarsSent()

    @property
    def path(self) -> str:
        return f"{self.run_dir}/engine-{os.getpid()}-{self.generation}.sock"

    @property
    def poll_socket(self):
        """What the front's poller watches: the listener until the engine connects, then the link."""
        return self.sock if self.sock is not None else self.listener

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def can_send(self) -> bool:
        return self.health.state == READY and not self.broken

    def broke(self, why: str, going_down: bool = False) -> None:
        """The first reason this incarnation cannot go on wins; why_dead() reports it."""
        self.broken = self.broken or why
        self.going_down = self.going_down or going_down

    def start(self) -> None:
        """Spawn an incarnation; it connects and says hello later, through receive()."""
        self._close_sock()
        self.generation += 1
        self.words = ""
        self.grammars = link.GrammarsSent()  # a new incarnation holds none
        self.arena.reset_heartbeat()
        self.claim(self.path)
        self.listener = seqpacket.listen(self.path)
        cfg = link.EngineProcessConfig(self.path, os.getpid(), self.arena.name, self.arena.n_input,
                                       self.engine, self.log_level, self.generation,
                                       self.factory, self.factory_args, calibrate=self.info is None)
        self.proc = mp.get_context("spawn").Process(target=engine_process, args=(cfg,), daemon=True,
                                                   name=f"meshnode-engine-{self.generation}")
        self.proc.start()
        self.health.starting(time.monotonic())

    def wait_ready(self, stop=lambda: False) -> EngineInfo | None:
        """Block until the first incarnation says hello (node start-up only); None if `stop()`."""
        while self.health.state == STARTING:
            if stop():
                return None
            if select.select([self.poll_socket], [], [], START_POLL_S)[0]:
                self.receive()
            why = self.why_dead(time.monotonic())
            if why:
                raise RuntimeError(f"engine did not start: {why}")
        return self.info

    def receive(self) -> link.TickDone | link.TickRefused | None:
        """Read one message: a tick's answer, or None (a connection, a hello, or anything that breaks the
        engine, which why_dead() then reports)."""
        if self.sock is None:
            self.sock = seqpacket.accept(self.listener, self.pid)
            if self.sock is not None:  # connected: the path is not needed any more
                self._close_listener()
            return None
        data = self.sock.recv()
        if data is None:
            return self.broke("engine closed the link", going_down=True)
        try:
            msg = link.decode(data)
        except ValueError as e:
            return self.broke(f"engine sent a malformed message: {e}")
        if isinstance(msg, link.Hello):
            return self._hello(msg)
        if isinstance(msg, link.HelloFailed):  # said before it exits, which why_dead() reports
            self.words = msg.detail
            return None
        if isinstance(msg, link.Aborted):
            self.words = f"llama.cpp aborted: {msg.detail}"
            return self.broke(self.words, going_down=True)
        if not isinstance(msg, (link.TickDone, link.TickRefused)):
            return self.broke(f"engine sent {type(msg).__name__}, which only the front sends")
        if isinstance(msg, link.TickRefused) and msg.fatal:  # its context cannot be trusted: restart, re-prefill
            return self.broke(f"engine reported a fatal error: {msg.detail}")
        return msg

    def _hello(self, msg: link.Hello) -> None:
        problem = model_problem(msg.info, self.info, self.n_vocab, self.model_path)
        if problem:  # no session can continue on another model: the node must say so and stop serving
            self.health.unrecoverable = self.broken = problem
            return None
        if self.info is None and not self.factory:  # later incarnations place layers as this one did
            self.engine = replace(self.engine, **msg.info.placement())
        self.info = self.info or msg.info
        self.health.ready(time.monotonic())
        return None

    def send(self, tick: Tick, fresh: bool = False) -> None:
        self._send([*self.grammars.ahead_of(tick.plan), link.TickRequest(tick.t, tick.plan, tick.resync, fresh)])

    def hurry(self, t: int) -> None:
        """Ask the engine to leave undone what it can of the ticks up to `t` (link.Hurry)."""
        self._send([link.Hurry(t)])

    def _send(self, messages: list) -> None:
        try:
            for msg in messages:
                self.sock.send(link.encode(msg, self.arena))
        except OSError as e:  # it stopped reading or is gone: why_dead() reports it, then the restart
            self.broke(f"engine link send failed: {e}", going_down=True)

    def why_dead(self, now: float, in_flight=()) -> str:
        """Why the engine is dead now, or "": exited, broken, silent at start, or hung in a tick (of
        `in_flight`, oldest first)."""
        if self.health.state not in (STARTING, READY):
            return ""
        if self.going_down and self.proc is not None:
            self.proc.join(EXIT_WAIT_S)  # a closed link is a process going down: let it finish, to say how
        if self.broken or now >= self._next_liveness:  # a dying engine closes its link: no waitpid every turn
            self._next_liveness = now + LIVENESS_EVERY_S
            if self.proc is not None and not self.proc.is_alive():
                self._read_last_words()
                return f"engine process exited (code {self.proc.exitcode})" + (f": {self.words}" if self.words else "")
        if self.broken:
            return self.words or self.broken
        return self.health.late_hello(now) or self.health.hung(now, in_flight, self.arena.heartbeat)

    def _read_last_words(self) -> None:
        """A dead engine may have said why (hello failed, abort) in messages still unread."""
        for _ in range(LAST_WORDS):
            sock = self.poll_socket
            if sock is None or not select.select([sock], [], [], 0)[0]:
                return
            self.receive()

    def missing_worker(self) -> str:
        """Why the first rpc worker the engine needs does not answer its hello, or "" (all do, or it needs none).
        Asked only while no engine is connected to them: a worker serves one client at a time."""
        return next(filter(None, (rpc_hello(ep, self.rpc_timeout_s) for ep in getattr(self.engine, "rpc", ()))), "")

    def died(self, why: str, counted: bool = True) -> None:
        """Kill what is left and let the health policy decide: restart with backoff, wait for a missing
        worker, or give up (`counted`: EngineHealth.died's)."""
        log.error("engine died: %s%s", why, "" if counted else " (while loading an imported KV: not counted "
                  "toward the crash loop)")
        self.kill()
        missing = self.missing_worker()
        self.health.died(time.monotonic(), why, missing=missing, counted=counted)
        if missing:
            log.error("%s: waiting for it, new sessions refused", missing)
        elif not self.health.healthy:
            log.error("not restarting the engine: %s", self.health.why_failed())

    def maybe_restart(self, now: float) -> None:
        h = self.health
        if h.missing and h.state == DOWN and now >= h.next_start_at:
            missing = self.missing_worker()
            if missing:
                return h.wait_for(now, missing)
            log.info("%s answers again: restarting the engine", " ".join(h.missing.split()[:3]))
        if h.restart_due(now):
            self.start()

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(KILL_WAIT_S)
            self.proc = None
        self._close_sock()

    def stop(self, timeout: float = KILL_WAIT_S) -> None:
        """Ask the engine to exit cleanly, then make sure it has; one that has not said hello yet has
        nothing to finish, and may not be reading the link at all (still loading): killed at once."""
        if self.proc is not None and self.proc.is_alive() and self.sock is not None and self.health.state == READY:
            try:
                self.sock.send(link.encode(link.Stop()))
            except OSError:
                pass
            self.proc.join(timeout)
        self.kill()

    def _close_sock(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._close_listener()
        self.broken, self.going_down = "", False

    def _close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
