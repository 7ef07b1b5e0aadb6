"""The front process: one thread, one poll loop, initialize / loop / shutdown.

The loop multiplexes the engine, the clients and timers. One step is
schedule, execute, update, as in vLLM's EngineCore: the scheduler plans
(meshnode/core), the tick driver sends and answers (ticks.py, the one owner of
the ticks in flight; engine_link.py is the process, why_dead() the one answer
to "is it dead"), the scheduler applies, and the output stage turns the events
into frames and decides the finishes only it can see (output.py). Each tick's
answer is applied and the next tick sent before the sessions' events go out
(so the engine never waits for the clients); client requests are answered at
once within their CPU share (requests.py says what a request does, clients.py
holds the sockets), and a full snapshot goes out every second (report.py).
Signal handlers only count (signals.py); the loop drains.
"""
from __future__ import annotations

import gc
import logging
import math
import os
import select
import time

import zmq

from ipc import link as wire
from ipc import events as E
from ipc import seqstate
from ipc.shm import TokenArena, clean_stale
from ipc.transport import Curve, EndpointLock, clean_stale_links, default_listen, default_telemetry, run_dir
from meshnode.core import reasons as R
from meshnode.core.budget import NodeBudget
from meshnode.core.types import ConfigError, Load, model_names
from meshnode.core.health import READY, EngineHealth
from meshnode.core.kvevents import BLOCK_TOKENS
from meshnode.core.scheduler import Event, Scheduler
from meshnode.core.telemetry import Telemetry
from meshnode.front import signals
from meshnode.front.clients import TELEMETRY_SUBSCRIBERS, Clients
from meshnode.front.engine_link import EngineLink
from meshnode.front.gate import SAFE_IPC_FDS, client_room
from meshnode.front.metrics import MAX_CONNECTIONS as METRICS_CONNECTIONS
from meshnode.front.handoff import Handoff
from meshnode.front.moves import Checked, Moves, read_key, remove
from meshnode.front.persist import KvPersist, folder_problem
from meshnode.front.prom import Exposition
from meshnode.front.gateway_child import GatewayChild
from meshnode.front.reaper import Reaper
from meshnode.front.report import Report, Sources, ready_line
from meshnode.front.output import Finish, Output
from meshnode.front.requests import Action, Answer, Opened, Requests
from meshnode.front.ticks import Refusal, Reply, Ticks
from meshnode.engine import llamacpp
from meshnode.ops.config import NodeConfig
from meshnode.ops.sdnotify import Notifier
from meshnode.text.jobs import TextJobs
from meshnode.text.tokenizer import Tokenizer

log = logging.getLogger("meshnode.front")
HANDOFF_CUT_S = 2.0  # at the drain's deadline, how long the peer has to answer the cancels of what it relays
PERSIST_S = 60.0  # the drain's last tick, which writes the prefix cache for kv_persist, may take this long


class StartStopped(Exception):
    """A signal arrived before the node was ready: a clean stop, not a failure."""


class Front:
    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.stopping = False
        self.notifier = Notifier()
        self._locks: list[EndpointLock] = []
        # set by initialize(); shutdown() releases whichever of them exist
        self.sched = self.link = self.clients = self.arena = self.zctx = self.tok = self.texts = self.requests = None
        self.reaper = self.gateway = self.moves = self.persist = self.handoff = None

    # -- initialize ------------------------------------------------------------------------
    def initialize(self) -> None:
        cfg = self.cfg
        signals.install()  # already done by `meshnode serve`; here for callers of serve() itself
        self.reaper = Reaper()  # first, while this process has no thread yet
        self.fd_limit, max_clients = client_room(cfg.max_clients, TELEMETRY_SUBSCRIBERS + METRICS_CONNECTIONS)
        if cfg.model is None:
            from meshnode.ops.models import cached_model
            cfg.model = str(cached_model("tiny"))
        self.settings = cfg.resolve()  # every derived value, every rule between settings: before anything starts
        try:
            self.mesh_key = read_key(cfg.mesh_key_file) if cfg.mesh_key_file else None
        except (OSError, ValueError) as e:
            raise ConfigError(str(e)) from None
        self._claim_endpoints()
        self.tok = Tokenizer(cfg.model)
        why = self.tok.vocab_difference(cfg.draft_model) if cfg.draft_model else ""
        if why:
            raise ConfigError(llamacpp.cannot_draft(cfg.draft_model, why))
        self.texts = TextJobs(self.tok.prompt_slices, decoding=lambda: self.sched is not None and bool(self.sched.running))
        self.zctx = zmq.Context()
        self.exposition = Exposition()
        # bound before the engine loads the model: a port in use fails the start in a second, not after it
        curve = Curve(cfg.curve_secret_key, cfg.curve_allow_dir) if cfg.curve_secret_key else None
        self.clients = Clients(self.zctx, self.listen, self.telemetry_ep, curve=curve, insecure=cfg.insecure,
                               max_clients=max_clients, metrics_listen=cfg.metrics_listen, busy=self._busy_clients,
                               idle_s=cfg.client_idle_timeout_s, per_host=cfg.max_clients_per_host,
                               evict_after_s=cfg.evict_after_s, exposition=self.exposition, kv_events=cfg.kv_events,
                               decoding=lambda: self.sched is not None and bool(self.sched.running))
        self.arena = TokenArena.create(wire.arena_tokens(cfg.n_batch))
        self.reaper.claim(f"/dev/shm/{self.arena.name}")
        self.health = EngineHealth(cfg.tick_deadline_s, cfg.start_timeout_s, cfg.restart_timeout_min_s)
        self.sched = self._start_engine()
        self.recipe = self.link.info.recipe
        b = self.budget  # what a router reads off /metrics as vLLM's cache config (front/prom.py)
        self.exposition.identify(model_names(cfg.served_model_name, os.path.basename(cfg.model))[0], {
            "block_size": BLOCK_TOKENS, "num_gpu_blocks": b.kv_budget_bytes // b.kv_bytes_per_token // BLOCK_TOKENS,
            "cache_dtype": cfg.type_k, "enable_prefix_caching": cfg.prefix_cache != "off", "kv_layout": cfg.layout})
        self.telemetry = Telemetry(self.sched)
        self.ticks = Ticks(self.link, cfg.pipeline_depth, self.telemetry)
        self.moves = Moves(seqstate.Layout.of(self.link.info.kv_state), self.budget.n_seq_max, time.monotonic,
                           self.budget.kv_budget_bytes, self.mesh_key,
                           proven=bool(cfg.curve_secret_key and cfg.curve_allow_dir))
        self.reaper.claim(self.moves.dir)
        problem = folder_problem(cfg.kv_persist) if cfg.kv_persist else ""
        if problem:
            log.error("kv_persist off: %s", problem)
        elif cfg.kv_persist:  # the prefix cache as the last drain left it; the first tick loads it
            self.persist = KvPersist(cfg.kv_persist, int(cfg.kv_persist_mb * 2**20), self.recipe,
                                     self.budget.kv_bytes_per_token, self.moves.checked)
            self.persist.restore(self.sched, self.budget.n_seq_max)
        self.output = Output(self.tok, self.clients.send, self.telemetry, latency=self.exposition,
                             export=self._exported, relays=lambda key: bool(self.handoff and self.handoff.relays(key)))
        self.report = Report(Sources(cfg, self.telemetry, self.link, self.health, self.clients, self.texts,
                                     self.notifier, self.budget, self.recipe, self.listen, self.telemetry_ep,
                                     self.fd_limit, self.sched.deterministic, self.link.info.devices,
                                     self.tok.tool_format))
        self.requests = Requests(self.sched, self.tok, self.texts, self.telemetry, status=self.report.status,
                                 metrics=lambda: E.metrics(self.exposition.render(self.report.snapshot()).decode()),
                                 moves=self.moves, relayed=lambda key: bool(self.handoff and self.handoff.cancel(key)),
                                 special_in_content=cfg.chat_special_in_content, pooling=cfg.pooling)
        self.poller = zmq.Poller()
        self.clients.register(self.poller)
        if cfg.handoff:
            self.handoff = Handoff(self.zctx, cfg.handoff, self.clients.send, self.output.end_moved,
                                   self.output.forget_moved, self.link.info.n_vocab)
            self.poller.register(self.handoff.sock, zmq.POLLIN)
        self.poller.register(self.texts.fileno(), zmq.POLLIN)
        self.poller.register(self.moves.fileno(), zmq.POLLIN)
        self._link_fd = None
        self._planned_out = False  # the last dispatch found nothing to plan
        self._probe_template()
        log.info("%s", ready_line(self.report.src, max_clients))
        if cfg.http:
            self.gateway = GatewayChild(cfg.http, self.listen, cfg.model, cfg.http_api_key_file, cfg.insecure,
                                        cfg.http_cors_origins, cfg.served_model_name,
                                        cfg.http_sampling_defaults, cfg.served_model_tags, cfg.http_metrics,
                                        cfg.reasoning_format)
        gc.freeze()  # what start-up built lives as long as the node: keep it out of every collection
        self.notifier.notify("READY=1", f"STATUS={self.report.status_line()}")

    def _probe_template(self) -> None:
        """The model's chat template compiled and run once on one user message before the ready line, so the
        first chat request pays neither, and a template that fails says so now (chat requests get its refusal)."""
        try:
            self.tok.chat_prompt([{"role": "user", "content": "hello"}])
        except ValueError as e:
            if "no chat template" not in str(e):
                log.warning("the model's chat template fails a probe render (chat requests will be refused with "
                            "its words; send text or tokens): %s", e)

    def _persist_kv(self) -> None:
        """At the drain's end, the prefix cache's entries to kv_persist in one last tick (front/persist.py)."""
        saving, saved = self.sched.save_cache(self.persist.to_save), {}
        deadline = time.monotonic() + PERSIST_S
        self._dispatch()
        while not self.ticks.idle and time.monotonic() < deadline and not self.ticks.why_dead(time.monotonic()):
            self._watch_link()
            if self._link_fd is not None and select.select([self._link_fd], [], [], 0.1)[0]:
                outcome = self.ticks.reply()
                if isinstance(outcome, Reply):
                    saved.update(outcome.result.saved)
                self._update(outcome)
            self._dispatch()
        self.persist.commit(saving, saved)

    def _claim_endpoints(self) -> None:
        """What a killed node left removed, and the client and telemetry endpoints locked for this one."""
        cfg = self.cfg
        for name in clean_stale():
            log.warning("removed stale shared memory segment %s", name)
        self.run_dir = str(run_dir())
        for name in clean_stale_links(self.run_dir):
            log.warning("removed a dead node's engine socket %s", name)
        self.listen = cfg.listen or default_listen()
        self.telemetry_ep = cfg.telemetry or default_telemetry()
        if self.fd_limit < SAFE_IPC_FDS and any(ep.startswith("ipc://") for ep in (self.listen, self.telemetry_ep)):
            log.warning("the descriptor limit is %d: a flood of connections on an ipc:// endpoint faster than the "
                        "node closes them aborts it inside libzmq (its ipc listener asserts on EMFILE); raise "
                        "LimitNOFILE (the unit sets 65536) or listen on tcp://", self.fd_limit)
        for ep in (self.listen, self.telemetry_ep):  # one at a time: a refused second releases the first
            self._locks.append(EndpointLock(ep))
            if self._locks[-1].path:
                self.reaper.claim(self._locks[-1].path)
                self.reaper.claim(self._locks[-1].path + ".lock")

    def _start_engine(self) -> Scheduler:
        """The first engine incarnation, and the scheduler sized by what it reports."""
        cfg = self.cfg
        self.link = EngineLink(self.run_dir, self.arena, self.health, engine=self.settings.engine,
                               n_vocab=self.tok.n_vocab, model_path=cfg.model, log_level=cfg.log_level,
                               rpc_timeout_s=cfg.rpc_timeout_s, factory=cfg.engine_factory,
                               factory_args=cfg.engine_args, claim=self.reaper.claim)
        missing = self.link.missing_worker()
        if missing:  # ggml would abort the engine mid-load: say which worker, at once
            raise RuntimeError(f"{missing}; start it (meshnode rpc-worker --listen HOST:PORT) or leave it out of --rpc")
        self.link.start()
        info = self.link.wait_ready(lambda: signals.received > 0)
        if info is None:
            raise StartStopped("stopped by a signal during start-up")
        self.budget = NodeBudget.from_engine(info, self.settings.budget)
        sched = Scheduler(self.budget, info.eog or [info.eos], self.settings.scheduler, recipe=info.recipe,
                          pool_cells=info.n_ctx if cfg.layout == "unified" else 0, deterministic=info.deterministic)
        if "regression" in info.deterministic_problem:  # a promise this build broke (engine/invariant.py, promised)
            log.warning("deterministic mode off: %s", info.deterministic_problem)
        sched.calibrated(info.calibration)
        return sched

    # -- loop -------------------------------------------------------------------------------
    def loop(self) -> None:
        drain_deadline = None
        while not self.stopping:
            now = time.monotonic()
            if signals.received and drain_deadline is None:
                drain_deadline = self._begin_drain(now)
            if signals.received > 1 or (drain_deadline and (now >= drain_deadline or not self._draining())):
                self._send(self.sched.end_all(R.DRAINED))
                if self.handoff is not None:
                    self.handoff.finish(HANDOFF_CUT_S)
                    self.clients.flush()
                if self.persist is not None and signals.received == 1:  # a second signal: stop now
                    self._persist_kv()
                break
            self._poll(timeout_ms=max(0, min(100, int(self.report.due(now) * 1e3), self._plan_in_ms(now))))
            now = time.monotonic()
            why = self.ticks.why_dead(now)
            if why:
                self._send(self._engine_died(why))
            self.link.maybe_restart(now)
            if self.sched.engine_down and self.health.state == READY:  # a missing worker is back
                self.sched.engine_down = None
            self._dispatch()
            for ident, id in self.moves.expired():
                self._apply([self.requests.refuse(ident, id, R.REJECTED_BAD_REQUEST, "its KV stopped coming (more "
                                                  "than IMPORT_IDLE_S between two kv parts)")])
            self.clients.publish_kv(self.sched.kv_events())
            self.clients.flush()
            if self.gateway is not None and drain_deadline is None:
                self.gateway.check(now)

    def _begin_drain(self, now: float) -> float:
        log.info("draining: new sessions refused, %d live get up to %.1f s", len(self.sched.live),
                 self.cfg.drain_timeout_s)
        self.sched.draining = True
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        if self.handoff is not None:  # every live session that can move goes to the peer (front/handoff.py)
            self._send(self.handoff.take(self.sched, self.moves.path))
        return now + self.cfg.drain_timeout_s

    def _draining(self) -> bool:
        """Sessions the drain still waits for: live ones, exports whose KV is still being read, and those a
        handoff relays."""
        return bool(self.sched.live or self.output.exporting) or bool(self.handoff and self.handoff.active)

    def _exported(self, ev: Event, stops: list[str]) -> list[list[bytes]]:
        """A leaving session's frames for its client, or nothing where a drain's handoff carries it on."""
        if self.handoff is not None and self.handoff.carries(ev, lambda: self.moves.state(ev, stops, self.recipe)):
            if ev.reason:  # it ended here first: nothing read its file (Moves.state removes the one it reads)
                remove(ev.session.export_to)
            return []
        return self.moves.exported(ev, stops, self.recipe)

    def _poll(self, timeout_ms: int) -> None:
        self._watch_link()
        wait = self.clients.watch(self.poller)
        if wait:  # out of CPU share: requests wait in the clients' queues; ticks go on
            timeout_ms = min(timeout_ms, max(1, int(wait * 1e3)))
        ready = dict(self.poller.poll(timeout_ms))
        if ready.pop(self._link_fd, None):
            self.step()
        if self.handoff is not None and ready.pop(self.handoff.sock, None):
            self.handoff.on_ready()
        if ready.pop(self.moves.fileno(), None):
            for key, done in self.moves.ready():
                if isinstance(done, Checked):
                    self._apply(self.requests.checked(key, done))
                else:
                    self._finish(self.output.export_ready(key, done))
        if ready.pop(self.texts.fileno(), None):
            for job in self.texts.finished():
                self._apply(self.requests.on_text(job))
        if ready:  # what is left is the clients'
            for ident, frames in self.clients.requests(ready):
                self._apply(self.requests.on_frames(ident, frames))
        if self.sched.take_hurry():  # a better first token is waiting
            self.ticks.hurry()

    def step(self) -> None:
        """An engine answer through the node, vLLM's EngineCore.step with the execution in the engine
        process: the answer applied by the scheduler, the pipeline refilled before any client hears (the
        engine never waits on the output), then the output."""
        events = self._update(self.ticks.reply())
        self._dispatch(after_reply=True)
        self._send(events)

    def _watch_link(self) -> None:
        """Poll the engine's current socket (the listener until it connects, then the link)."""
        sock = self.link.poll_socket
        fd = sock.fileno() if sock is not None else None
        if fd != self._link_fd:
            if self._link_fd is not None:  # by the number it had: a closed socket's fileno() is -1
                self.poller.unregister(self._link_fd)
            if fd is not None:
                self.poller.register(fd, zmq.POLLIN)
            self._link_fd = fd

    # -- clients ---------------------------------------------------------------------------------
    def _busy_clients(self) -> set:
        """Client identities with a live session or a text being tokenized: their connections stay."""
        busy = {key[0] for key in self.sched.live} if self.sched is not None else set()
        if self.handoff is not None:
            busy |= {r.key[0] for r in self.handoff.routes.values()}
        return busy | set(self.requests.held) if self.requests is not None else busy

    def _apply(self, actions: list[Action]) -> None:
        """What a request handler decided, in its order."""
        for a in actions:
            if isinstance(a, Opened):
                self.output.opened(a.session, a.stops)
            elif isinstance(a, Answer):
                self._finish(self.output.answer(a.ident, a.frames))
            else:
                self._send([a])

    def _send(self, events: list[Event]) -> None:
        """Events out as frames (output.py); the sessions the output stage ended, ended in the scheduler."""
        self._finish(self.output.process(events))

    def _finish(self, finishes: list[Finish]) -> None:
        """The scheduler hears each finish the output stage decided (a stop string, a client gone) once; the
        session's `done` is out already, so the scheduler's event for it is not sent again."""
        for f in finishes:
            self.sched.end(f.key, f.reason)

    # -- engine ----------------------------------------------------------------------------------
    def _dispatch(self, after_reply: bool = False) -> None:
        """Send ticks until the pipeline is full or there is nothing to do. A tick sent to an idle engine
        that did not just answer is `fresh` (Ticks.send)."""
        self._planned_out = False
        while self.ticks.room:
            if time.monotonic() < self.ticks.due(self.sched.gather_until()):
                return  # late in the running tick, or gathering requests: the poll wakes for it (_plan_in_ms)
            tick = self.sched.plan()
            if tick is None:
                self._planned_out = True  # only an event (a request, an answer) can make more
                return
            self.ticks.send(tick, fresh=not after_reply and self.ticks.idle)

    def _plan_in_ms(self, now: float) -> int:
        """How long the poll may wait before the next tick is due to be planned (Ticks.due)."""
        at = self.ticks.due(self.sched.gather_until()) if self.ticks.room and not self._planned_out else 0.0
        return max(0, math.ceil((at - now) * 1e3)) if at else 100

    def _update(self, outcome: Reply | Refusal | None) -> list[Event]:
        """A tick's outcome -> the sessions' events (sent by the caller, after the next dispatch)."""
        if outcome is not None and outcome.tick.plan.kv:
            self.moves.ran(outcome.tick.plan)
        if isinstance(outcome, Reply):
            self.sched.mem_available = outcome.mem_available
            return self.sched.apply(outcome.tick, outcome.result)
        if isinstance(outcome, Refusal):
            log.error("engine refused a plan: %s", outcome.detail)
            return self.sched.refused(outcome.tick, R.ENGINE_ERROR, outcome.behind)
        return []  # nothing, or the engine broke: the loop asks why_dead() next

    def _engine_died(self, why: str) -> list[Event]:
        """Restart with backoff and re-prefill; when the engine cannot come back, or waits for a missing
        rpc worker, end every session."""
        loading = any(isinstance(op, Load) for tick in self.ticks.in_flight() for op in tick.plan.kv)
        self.link.died(why, counted=not loading)
        self.ticks.lost()
        self.sched.engine_restarted()
        if self.health.serving:
            return []
        # given up, or waiting for a worker for as long as it takes: nobody is kept waiting for that
        self.sched.engine_down = self.health.missing or self.health.last_error
        ended = self.sched.end_all(R.ENGINE_ERROR)
        for ev in ended:
            ev.detail = self.sched.engine_down
        return ended

    # -- shutdown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release everything initialize() got this far, in reverse dependency order."""
        if self.sched is not None and self.sched.live and self.clients is not None:
            self._send(self.sched.end_all(R.DRAINED))
        # destroy, not term: a start that failed half-way (a port in use) leaves sockets no owner closes,
        # and term would wait for them for ever
        steps = [(self.gateway, "stop"), (self.link, "stop"), (self.texts, "close"), (self.handoff, "close"),
                 (self.clients, "close"),
                 (self.moves, "close"),
                 (self.arena, "close"),
                 (self.zctx, "destroy"), *((lock, "release") for lock in self._locks), (self.tok, "close"),
                 (self.notifier, "close"), (self.reaper, "done")]
        for obj, method in steps:
            if obj is not None:
                getattr(obj, method)()


def serve(cfg: NodeConfig) -> int:
    front = Front(cfg)
    try:
        front.initialize()
        front.loop()
    except StartStopped as e:
        log.info("%s", e)
    finally:
        front.shutdown()
    return 0
