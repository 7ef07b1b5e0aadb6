"""The engine process: owns the llama.cpp context, runs one tick per message.

Isolation is the point: a crash, a hang or a leak in llama.cpp kills only this
process; the front restarts it and re-prefills the sessions. The loop is
initialize / loop / shutdown; it exits on a `stop` message, when the link
closes, or when the front dies (PR_SET_PDEATHSIG, plus a getppid check for
the window before prctl takes effect). What the front leaves behind when it
is killed is its reaper's to remove, not this process's. The main thread only runs steps: the
link's reading, writing and memory figures happen beside the decode, on the
threads of meshnode/engine/link_io.py.

Fault injection (`faults` in the config) exists only for tests; with no
faults configured, none of its branches can run.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import time

from ipc import link as L
from ipc import seqpacket
from ipc.shm import TokenArena
from meshnode.engine.chain import Chain
from meshnode.worker.link_io import CLOSED, STOP, LinkIO, Tick
from meshnode.core.types import EngineError, FatalEngineError, InvalidPlan

log = logging.getLogger("meshnode.engine")
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGTERM us when the front dies: the loop then exits and cleans up what the front left."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() != parent:  # the front died before prctl took effect
        os._exit(0)


def build_engine(cfg: dict, report_abort=None):
    if cfg.get("kind") == "fake":
        from meshnode.engine.fake import FakeEngine

        return FakeEngine(**cfg.get("fake", {}))
    from meshnode.engine import llamacpp
    from meshnode.engine.llama import EngineConfig, LlamaEngine

    if report_abort is not None:
        llamacpp.on_abort(report_abort)
    return LlamaEngine(EngineConfig(**cfg["engine"]))


def engine_info(engine) -> dict:
    return {"pid": os.getpid(), "n_vocab": engine.n_vocab, "eos": engine.eos, "eog": list(engine.eog),
            "n_seq_max": engine.n_seq_max, "n_ctx": engine.n_ctx, "n_ctx_seq": engine.n_ctx_seq,
            "n_batch": engine.n_batch, "kv_bytes_per_token": engine.kv_bytes_per_token,
            "weight_bytes": engine.weight_bytes, "recipe": engine.recipe_fingerprint}


class EngineProcess:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.faults = cfg.get("faults") or {}
        self.stop = False
        self.ticks = 0
        self._ready_at = 0.0
        self.chain = Chain()

    def initialize(self) -> None:
        _die_with_parent(self.cfg["parent_pid"])
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front owns Ctrl-C and drains
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop", True))
        logging.basicConfig(level=self.cfg.get("log_level", "WARNING"),
                            format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
        if self.cfg.get("log_level") != "DEBUG":  # llama.cpp's load chatter only when debugging
            logging.getLogger("meshnode.llama").setLevel(logging.WARNING)
        if self.faults.get("die_at_start"):
            os._exit(3)
        self.sock = seqpacket.connect(self.cfg["link"])
        a = self.cfg["arena"]
        self.arena = TokenArena.attach(a["name"], a["n_input"], a["n_output"])
        try:
            self.engine = build_engine(self.cfg, self._aborting)
        except Exception as e:
            self.sock.send(L.hello_failed(f"{type(e).__name__}: {e}"))
            raise
        time.sleep(self.faults.get("sleep_at_start", 0))  # a slow model load
        if self.faults.get("stop_at_hello"):  # as if SIGSTOPped by an operator before it could answer
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.faults.get("abort_at_start"):  # as if a GGML_ASSERT failed while loading
            from meshnode.engine import llamacpp

            llamacpp.abort("GGML_ASSERT(injected) failed")
        gc.freeze()  # the model and the process's start-up stay for good: no collection walks them
        self.sock.send(L.hello(engine_info(self.engine)))
        self.io = LinkIO(self.sock, self.arena)

    def _aborting(self, message: str) -> None:
        """ggml is about to abort the process: tell the front why, in one line, while we can."""
        log.critical("llama.cpp aborted: %s", message)
        try:
            self.sock.send(L.aborted(message))
        except OSError:
            pass

    def loop(self) -> None:
        parent = self.cfg["parent_pid"]
        self.io.start()
        while not self.stop:
            tick = self.io.next(0.5)
            if tick is None:
                if os.getppid() != parent:
                    return
                continue
            if tick in (STOP, CLOSED):
                return
            t = tick.t if isinstance(tick.t, int) else 0
            self.arena.beat(t, finished=False)  # the front judges a hang by this, not by its own clock
            reply = self.tick(tick)
            self.arena.beat(t, finished=True)
            self.io.reply(*reply)

    def tick(self, tick: Tick) -> tuple[dict, tuple | None]:
        """The reply, and what the link writes to the arena before sending it."""
        self.ticks += 1
        try:
            if tick.error:  # its fields did not decode: refused like any bad plan
                raise InvalidPlan(tick.error)
            fault = self._due_fault()
            self._inject_faults(fault)
            res = self.chain.step(self.engine, tick.plan, tick.resync)
            if fault == "bad_sample":
                res.tokens = dict.fromkeys(res.tokens, self.engine.n_vocab)  # ids the vocabulary lacks
        except (EngineError, ValueError) as e:
            fatal = getattr(e, "fatal", False)
            if not fatal:
                self.chain.failed()
            log.error("tick %s failed: %s", tick.t, e)
            return L.tick_failed(tick.t, fatal, str(e)), None
        except Exception as e:  # an unexpected bug: the context can't be trusted any more
            log.exception("tick %s raised", tick.t)
            return L.tick_failed(tick.t, True, f"{type(e).__name__}: {e}"), None
        ready = time.perf_counter()
        # the time between two engine steps: from the last result being ready to this step starting
        # (the main thread's hand-over, the wait for this tick, resolving its follows); -1 after an idle spell
        gap_ms = (ready - self._ready_at) * 1e3 - res.step_ms if self._ready_at and not tick.fresh else -1.0
        self._ready_at = ready
        return L.tick_ok(tick.t, res.cache_miss, res.step_ms, res.kv_cells, gap_ms), (tick.out, tick.plan, res)

    def _due_fault(self) -> str | None:
        """The fault a test asked for at this tick, if any."""
        f = self.faults
        return f.get("kind") if f and self.ticks == f.get("at_tick", -1) else None

    def _inject_faults(self, kind: str | None) -> None:
        if kind == "fatal":
            raise FatalEngineError("injected: llama_decode returned -3")
        if kind == "raise":
            raise RuntimeError("injected exception in step")
        if kind == "refuse":
            raise InvalidPlan("injected: a plan the engine refuses")
        if kind == "hang":
            time.sleep(3600)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "abort":
            from meshnode.engine import llamacpp

            llamacpp.abort("GGML_ASSERT(injected) failed")

    def shutdown(self) -> None:
        """Close what this process opened. What the front owns (its sockets, locks, the arena) is
        its reaper's to remove if it was killed (meshnode/reaper.py), never ours."""
        if hasattr(self, "io"):
            self.io.close()  # first: its reader copies tokens out of the arena
        for name in ("arena", "engine"):
            obj = getattr(self, name, None)
            if obj is not None and hasattr(obj, "close"):
                obj.close()
        if hasattr(self, "sock"):
            self.sock.close()


def engine_main(cfg: dict) -> None:
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
