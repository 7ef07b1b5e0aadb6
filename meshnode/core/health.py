"""The engine's health: when it counts as dead, when it starts again, when the node gives up. Pure.

Death is judged from what the engine itself reports: a tick counts as hung only
when the engine has not finished it past the deadline, by the heartbeat it
stamps in the shared arena (meshnode/worker/main.py), never by how long the
front took to read an answer. An incarnation must say hello within a deadline
derived from how long the first one took (with a floor). Restarts back off
exponentially; a crash loop (too many deaths in a row without one good tick)
marks the node unhealthy and stops respawning, so it reports instead of
spinning. So does an incarnation whose model is not the one the node serves.
An engine that died while an RPC worker it needs does not answer is not in a
crash loop: the node waits for the worker (`missing`), probing with a backoff
capped at DEVICE_RETRY_MAX_S for as long as it takes, and refuses new work
meanwhile with the worker named.
"""
from __future__ import annotations

from meshnode.core.types import EngineInfo

STARTING, READY, DOWN, FAILED = "STARTING", "READY", "DOWN", "FAILED"
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 5.0
CRASH_LOOP_DEATHS = 5  # deaths in a row with no good tick between them
RESTART_FACTOR = 5  # a restart may take this many times the measured first start (page cache, load)
DEVICE_RETRY_FIRST_S, DEVICE_RETRY_MAX_S = 0.5, 30.0  # probing a missing rpc worker: one line per probe at most


def model_problem(hello: EngineInfo, first: EngineInfo | None, n_vocab: int, model_path: str) -> str:
    """Why an incarnation cannot serve this node ("" if it can): every hello is checked here, the first
    against the front's tokenizer, later ones against the first."""
    if first is None:
        if hello.n_vocab != n_vocab:
            return (f"the engine's model has {hello.n_vocab} tokens, the front's tokenizer {n_vocab}: "
                    f"{model_path} changed while the node started")
        return ""
    if hello.deterministic != first.deterministic:
        return (f"the restarted engine's deterministic mode is {'on' if hello.deterministic else 'off'}, the node "
                f"started with it {'on' if first.deterministic else 'off'} ({hello.deterministic_problem or 'its check'}"
                "); restart the node")
    if (hello.recipe, hello.n_vocab) != (first.recipe, first.n_vocab):
        return (f"the restarted engine loaded a different model (recipe {hello.recipe}, this node serves "
                f"{first.recipe}): {model_path} changed; restart the node")
    return ""


class EngineHealth:
    def __init__(self, tick_deadline_s: float, start_timeout_s: float, restart_timeout_min_s: float):
        self.tick_deadline_s = tick_deadline_s
        self.start_timeout_s, self.restart_timeout_min_s = start_timeout_s, restart_timeout_min_s
        self.state = DOWN
        self.first_start_s: float | None = None  # measured: spawn to hello of the first incarnation
        self.started_at = self.next_start_at = 0.0
        self.restarts = self.deaths_in_row = 0
        self.last_error = ""  # why the engine last died
        self.unrecoverable = ""  # a death no restart can cure
        self.missing = ""  # an rpc worker the engine needs that does not answer (why, naming it)
        self.waits = 0  # probes of it that failed in a row

    @property
    def healthy(self) -> bool:
        """Not given up: the node itself works (systemd's watchdog is fed), maybe waiting for a worker."""
        return self.state != FAILED

    @property
    def serving(self) -> bool:
        """What clients and operators are told as `healthy`: not given up and not waiting for a worker."""
        return self.healthy and not self.missing

    @property
    def hello_deadline_s(self) -> float:
        """How long an incarnation may take to say hello: the configured start timeout the first
        time, then a multiple of what the first start measured (never below the floor)."""
        if self.first_start_s is None:
            return self.start_timeout_s
        return min(self.start_timeout_s, max(self.restart_timeout_min_s, RESTART_FACTOR * self.first_start_s))

    def starting(self, now: float) -> None:
        self.state, self.started_at = STARTING, now

    def ready(self, now: float) -> None:
        """The incarnation said hello (and its model passed the check)."""
        self.state, self.missing, self.waits = READY, "", 0
        if self.first_start_s is None:
            self.first_start_s = now - self.started_at

    def good_tick(self) -> None:
        self.deaths_in_row = 0

    def late_hello(self, now: float) -> str:
        if self.state == STARTING and now - self.started_at > self.hello_deadline_s:
            return f"engine did not say hello within {self.hello_deadline_s:.1f} s"
        return ""

    def hung(self, now: float, in_flight, heartbeat) -> str:
        """A tick the engine has not finished, late by the engine's own heartbeat (`heartbeat()`:
        started, finished, when either changed). A finished tick whose answer waits unread is never
        late, however long the front was busy. `in_flight`: the pipeline's ticks, oldest first."""
        if not in_flight or now - in_flight[0].sent_at <= self.tick_deadline_s:
            return ""  # nothing can be late yet: no need to read the heartbeat (it runs every loop turn)
        started, finished, changed = heartbeat()
        late = next((tk for tk in in_flight if tk.t > finished), None)
        if late is None:
            return ""
        since = max(changed, late.sent_at)  # it could not start before it got the tick
        if now - since <= self.tick_deadline_s:
            return ""
        where = "in its step" if started == late.t else "without taking it"
        return f"tick {late.t} ran past its {self.tick_deadline_s:.1f} s deadline ({now - since:.1f} s {where})"

    def died(self, now: float, why: str, unrecoverable: str = "", missing: str = "", counted: bool = True) -> None:
        """Count a death: schedule a restart with backoff, or give up (crash loop, or a model no
        restart can fix); or, where a worker it needs is `missing`, wait for that. `counted` False: a
        death a client's input may have caused (a tick loading an imported KV, which is never loaded
        again): it restarts the engine but does not bring the crash loop nearer, or clients could stop the
        node for good by importing."""
        self.last_error = why
        self.unrecoverable = self.unrecoverable or unrecoverable
        if missing and not self.unrecoverable:
            return self.wait_for(now, missing)
        self.deaths_in_row += 1 if counted else 0
        if not counted and not self.unrecoverable:
            self.state, self.next_start_at = DOWN, now + BACKOFF_FIRST_S
            return
        if self.unrecoverable or self.deaths_in_row >= CRASH_LOOP_DEATHS:
            self.state = FAILED
            return
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.deaths_in_row - 1))
        self.state, self.next_start_at = DOWN, now + delay

    def wait_for(self, now: float, missing: str) -> None:
        """A worker the engine needs does not answer: probe again later, backing off."""
        self.missing = missing
        self.waits += 1
        self.state, self.next_start_at = DOWN, now + min(DEVICE_RETRY_MAX_S, DEVICE_RETRY_FIRST_S * 2 ** (self.waits - 1))

    def restart_due(self, now: float) -> bool:
        if self.state == DOWN and now >= self.next_start_at:
            self.restarts += 1
            return True
        return False

    def why_failed(self) -> str:
        return self.unrecoverable or f"crash loop, {self.deaths_in_row} deaths in a row"
