"""The engine process: owns the llama.cpp context, runs one tick per request.

Isolation is the point: a crash, a hang or a leak in llama.cpp kills only this
process; the front restarts it and re-prefills the sessions. The process is
initialize / loop / shutdown; it exits on a Stop, when the link closes, or when
the front dies (PR_SET_PDEATHSIG, plus a getppid check for the window before
prctl takes effect). The main thread only runs steps: reading ticks, sending
answers and measuring memory happen beside the decode (link_io.py). What the
front leaves behind when it is killed is its reaper's to remove, not ours.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import os
import signal
import sys
import time
from dataclasses import replace

from ipc import link, seqpacket, seqstate
from ipc.link import EngineProcessConfig
from ipc.shm import TokenArena
from meshnode.core.types import EngineError, EngineInfo, InvalidPlan, StepResult
from meshnode.engine.followups import Followups
from meshnode.worker.link_io import CLOSED, LinkIO
from meshnode.worker.warming import Warming

log = logging.getLogger("meshnode.engine")
PR_SET_PDEATHSIG = 1
PARENT_CHECK_S = 0.5  # an idle engine checks this often that the front that spawned it still lives


def _die_with_parent(parent: int) -> None:
    """SIGTERM us when the front dies: the loop then exits."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() != parent:  # the front died before prctl took effect
        os._exit(0)


def build_engine(cfg: EngineProcessConfig, report_abort=None):
    """llama.cpp's engine, or the one the node's engine_factory names (tests: a fake, faults injected); the
    factory is imported by name, so this shell imports nothing of meshnode/dev."""
    from meshnode.engine import llamacpp

    if report_abort is not None:  # whoever builds it: a factory's engine may be llama.cpp's too
        llamacpp.on_abort(report_abort)
    if cfg.factory:
        module, _, name = cfg.factory.partition(":")
        return getattr(importlib.import_module(module), name)(cfg.engine, cfg.factory_args or {}, cfg.generation)
    from meshnode.engine.llama import LlamaEngine

    return LlamaEngine(cfg.engine)


class EngineProcess:
    def __init__(self, cfg: EngineProcessConfig):
        self.cfg = cfg
        self.stop = False
        self._ready_at = 0.0
        self._tick = -1  # the tick running now (the one a link.Hurry may name)
        self.followups = Followups()

    def initialize(self) -> None:
        _die_with_parent(self.cfg.parent_pid)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front owns Ctrl-C and drains
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop", True))
        logging.basicConfig(level=self.cfg.log_level,
                            format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
        if self.cfg.log_level != "DEBUG":  # llama.cpp's load chatter only when debugging
            logging.getLogger("meshnode.llama").setLevel(logging.WARNING)
        self.sock = seqpacket.connect(self.cfg.link_path)
        self.arena = TokenArena.attach(self.cfg.arena_name, self.cfg.arena_input)
        try:
            self.engine = build_engine(self.cfg, self._aborting)
        except Exception as e:
            self.sock.send(link.encode(link.HelloFailed(f"{type(e).__name__}: {e}")))
            raise
        # a restart keeps the front's cost model: only the first incarnation pays for the timing
        calibration = self.engine.calibrate() if self.cfg.calibrate and hasattr(self.engine, "calibrate") else ()
        gc.freeze()  # the model and the process's start-up stay for good: no collection walks them
        info = replace(EngineInfo.of(self.engine, calibration), kv_state=kv_layout(self.engine, self.cfg.link_path))
        self.sock.send(link.encode(link.Hello(os.getpid(), info)))
        self.io = LinkIO(self.sock, self.arena)
        if hasattr(self.engine, "build_matchers"):
            self.warming = Warming(self.engine.build_matchers)
            self.engine.matchers_source = self.warming.get
        if self.cfg.engine.hurry:  # a node whose ticks may be hurried (the priority policy: EngineConfig.hurry)
            self.engine.hurry_when(self._hurried)
        if hasattr(self.engine, "see_link"):  # a test's fault that must wait for a tick queued behind it
            self.engine.see_link(self.io.queued)

    def _aborting(self, message: str) -> None:
        """ggml is about to abort the process: tell the front why, in one line, while we can."""
        log.critical("llama.cpp aborted: %s", message)
        try:
            self.sock.send(link.encode(link.Aborted(message)))
        except OSError:
            pass

    def loop(self) -> None:
        self.io.start()
        while not self.stop:
            msg = self.io.next(PARENT_CHECK_S)
            if msg is None:
                if os.getppid() != self.cfg.parent_pid:
                    return
                continue
            if msg is CLOSED or isinstance(msg, link.Stop):
                return
            self.arena.beat(msg.tick, finished=False)  # the front judges a hang by this, not by its clock
            self._tick = msg.tick
            out = self.run(msg)  # the answer is sent, and "finished" beaten, by the link's writer
            if isinstance(out, link.TickRefused):
                self.io.refuse(out)
            else:
                self.io.done(msg.tick, *out)

    def _hurried(self) -> bool:
        """The front asked the tick running now to hurry (link.Hurry names it or one behind it)."""
        return self.io.hurry >= self._tick

    def run(self, req) -> link.TickRefused | tuple[StepResult, float]:
        """Run one tick request: its refusal, or its result and the gap before it (ms; -1 after an idle
        spell), which the link's writer turns into a TickDone."""
        try:
            if isinstance(req, link.MalformedTick):  # refused like any bad plan, in its place
                raise InvalidPlan(str(req))
            res = self.followups.run(self.engine, req.plan, req.resync, hurried=self._hurried())
        except (EngineError, ValueError) as e:
            fatal = getattr(e, "fatal", False)
            if not fatal:
                self.followups.refused()
            log.error("tick %s failed: %s", req.tick, e)
            return link.TickRefused(req.tick, fatal, str(e))
        except Exception as e:  # an unexpected bug: the context can't be trusted any more
            log.exception("tick %s raised", req.tick)
            return link.TickRefused(req.tick, True, f"{type(e).__name__}: {e}")
        ready = time.perf_counter()
        # the time between two engine steps: from the last result being ready to this step starting
        # (the main thread's hand-over, the wait for this tick, resolving its follows); -1 after an idle spell
        gap_ms = (ready - self._ready_at) * 1e3 - res.step_ms if self._ready_at and not req.fresh else -1.0
        self._ready_at = ready
        return res, gap_ms

    def shutdown(self) -> None:
        if hasattr(self, "io"):
            self.io.close()  # first: its reader copies tokens out of the arena
        if hasattr(self, "warming"):
            self.warming.wait()  # it reads the engine's model
        for name in ("arena", "engine"):
            obj = getattr(self, name, None)
            if obj is not None and hasattr(obj, "close"):
                obj.close()
        if hasattr(self, "sock"):
            self.sock.close()


def engine_main(cfg: EngineProcessConfig) -> None:
    """Spawn target."""
    proc = EngineProcess(cfg)
    code = 0
    try:
        proc.initialize()
        proc.loop()
    except Exception:
        log.exception("engine process failed")
        code = 1
    finally:
        proc.shutdown()
    sys.exit(code)


def kv_layout(engine, near: str) -> tuple:
    """What the engine's state files hold (ipc/seqstate.Layout.wire), learned from one it writes itself next to
    `near` (the run dir); () where it writes none or seqstate cannot check its kind (its KV imports are refused
    and prefilled instead)."""
    path = f"{near}.kvsample"
    try:
        if not engine.kv_sample(path):
            return ()
        return seqstate.learn(path).wire()
    except (OSError, ValueError) as e:
        log.warning("KV imports off: this model's state files are not of a kind the node checks (%s)", e)
        return ()
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
