"""An engine that fails on purpose, the way a test asked: chosen when the engine is built, never in production.

The engine process wraps its engine in `Faulty` only when its configuration
carries faults and names this class as their wrapper (only the test and drill
entry, meshnode/dev/serve.py, can put them there; the worker imports it by that
name, so no production module imports this one). Start-up faults happen while it is built, before the engine
says hello; a tick fault happens inside the tick that holds the `at_tick`-th decode step.
"""
from __future__ import annotations

import os
import signal
import time

from meshnode.core.types import FatalEngineError, InvalidPlan


class Faulty:
    def __init__(self, engine, faults: dict):
        self.engine, self.faults, self.steps = engine, faults, 0
        self.queued = lambda: True  # the link's "a tick is waiting behind this one", once the worker has a link
        time.sleep(faults.get("sleep_at_start", 0))  # a slow model load
        if faults.get("die_at_start"):
            os._exit(3)
        if faults.get("abort_at_start"):  # as if a GGML_ASSERT failed while loading
            from meshnode.engine import llamacpp

            llamacpp.abort("GGML_ASSERT(injected) failed")
        if faults.get("stop_at_hello"):  # as if SIGSTOPped by an operator before it could answer
            os.kill(os.getpid(), signal.SIGSTOP)

    def see_link(self, queued) -> None:
        self.queued = queued

    def _wait_for_a_tick_behind(self, ceiling_s: float = 30.0) -> None:
        """A refusal is meant to meet a tick the front already queued behind it; refused at once, it may
        come back before the front sends that tick (pipelined ticks go out late in the one running), and
        the path under test would depend on the machine's speed. The ceiling only ends a test gone wrong."""
        end = time.monotonic() + ceiling_s
        while not self.queued() and time.monotonic() < end:
            time.sleep(0.001)

    def __getattr__(self, name):  # the engine's shape, close(), ...
        return getattr(self.engine, name)

    def step(self, plan):
        before, self.steps = self.steps, self.steps + plan.steps  # a multi-step tick's steps each count
        at = self.faults.get("at_tick")
        kind = self.faults.get("kind") if at is not None and before < at <= self.steps else None
        if kind == "fatal":
            raise FatalEngineError("injected: llama_decode returned -3")
        if kind == "raise":
            raise RuntimeError("injected exception in step")
        if kind == "refuse":
            if self.faults.get("with_a_tick_behind"):
                self._wait_for_a_tick_behind()
            raise InvalidPlan("injected: a plan the engine refuses")
        if kind == "hang":
            time.sleep(3600)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "abort":
            from meshnode.engine import llamacpp

            llamacpp.abort("GGML_ASSERT(injected) failed")
        time.sleep(self.faults.get("step_sleep_s", 0))  # a slow engine: every tick takes at least this long
        res = self.engine.step(plan)
        if kind == "bad_sample":
            res.tokens = dict.fromkeys(res.tokens, self.engine.n_vocab)  # ids the vocabulary lacks
        return res
