"""The front process: clients, admission, the tick loop, telemetry. One thread.

One zmq poll loop multiplexes the client ROUTER, the engine link and timers:
client frames are decoded and answered at once (admission never waits for a
tick), the next tick is planned and sent while the engine still runs the
current one (so the engine never waits for this process), each reply becomes
`tokens` / `done` events, and a full telemetry snapshot goes out every second.
Signal handlers only set flags; the loop drains. All policy lives in the pure
Scheduler; this file only moves bytes and keeps every session's promise of
exactly one `done`.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from collections import deque

import zmq

from ipc import link as L
from ipc import protocol as P
from meshnode.core import reasons as R
from ipc.shm import TokenArena, clean_stale
from ipc.transport import CLIENT_HWM, Curve, check_private, EndpointLock, clean_stale_links, client_router, default_listen, \
    default_telemetry, run_dir, telemetry_pub
from meshnode import __version__
from meshnode.front import signals
from meshnode.core.budget import NodeBudget
from meshnode.ops.config import NodeConfig
from meshnode.core.cpushare import RECEIVE_S_PER_BYTE, CpuShare
from meshnode.front.metrics import MAX_CONNECTIONS as METRICS_CONNECTIONS
from meshnode.front.engine_link import FAILED, EngineLink
from meshnode.front.gate import RESERVE_FDS, Gate, descriptors, open_descriptors
from meshnode.ops.memory import rss
from meshnode.front.outbox import GONE, STALLED, Outbox
from meshnode.front.reaper import Reaper
from meshnode.core.scheduler import Event, Scheduler
from meshnode.ops.sdnotify import Notifier
from meshnode.core.session import Ask, Session
from meshnode.core.telemetry import Telemetry
from meshnode.text.jobs import TextJobs
from meshnode.text.tokenizer import TextStream, Tokenizer

log = logging.getLogger("meshnode.front")
PUBLISH_EVERY_S = 1.0
STATUS_EVERY_S = 5.0
CLIENT_SLICE_S = 0.004  # client requests handled per loop turn, at most: then the engine link's turn
MAX_HELD = 256  # a client's requests waiting behind its text being tokenized
TELEMETRY_SUBSCRIBERS = 64  # connections the telemetry PUB accepts


class Front:
    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.stopping = False
        self.streams: dict = {}
        self.held: dict[bytes, deque] = {}  # a client's requests behind its text being tokenized
        self.notifier = Notifier()
        self._auth: list = []
        self._locks: list[EndpointLock] = []
        self._poller_link = self._link_fd = None  # the engine link the poller watches, and its fd
        self._front_rss = rss()
        self._fds_open, self.gates = 0, []
        self.share = CpuShare(time.perf_counter())
        # set by initialize(); shutdown() releases whichever of them exist
        self.sched = self.link = self.router = self.pub = self.metrics = None
        self.arena = self.zctx = self.tok = self.texts = self.reaper = None

    # -- initialize ------------------------------------------------------------------
    def initialize(self) -> None:
        cfg = self.cfg
        signals.install()  # already done by `meshnode serve`; here for callers of serve() itself
        self.reaper = Reaper()  # first, while this process has no thread yet
        self.fd_limit, for_connections = descriptors()
        self.max_clients = min(cfg.max_clients, for_connections - TELEMETRY_SUBSCRIBERS - METRICS_CONNECTIONS)
        if self.max_clients < 1:
            raise RuntimeError(f"the descriptor limit ({self.fd_limit}) leaves no room for clients; raise it "
                               f"(LimitNOFILE= in the unit, ulimit -n) to at least {RESERVE_FDS + 100}")
        if self.max_clients < cfg.max_clients:
            log.warning("the descriptor limit (%d) allows %d client connections, not max_clients=%d",
                        self.fd_limit, self.max_clients, cfg.max_clients)
        if cfg.model is None:
            from meshnode.ops.models import cached_model
            cfg.model = str(cached_model("tiny"))
        for name in clean_stale():
            log.warning("removed stale shared memory segment %s", name)
        self.run_dir = str(run_dir())
        for name in clean_stale_links(self.run_dir):
            log.warning("removed a dead node's engine socket %s", name)
        self.listen = cfg.listen or default_listen()
        self.telemetry_ep = cfg.telemetry or default_telemetry()
        for ep in (self.listen, self.telemetry_ep):  # one at a time: a refused second releases the first
            self._locks.append(EndpointLock(ep))
            if self._locks[-1].path:
                self.reaper.claim(self._locks[-1].path)
                self.reaper.claim(self._locks[-1].path + ".lock")
        self.tok = Tokenizer(cfg.model)
        self.texts = TextJobs(self.tok.encode)
        self.zctx = zmq.Context()
        self.arena = TokenArena.create(*L.arena_shape(cfg.n_batch, cfg.n_seq_max))
        self.reaper.claim(f"/dev/shm/{self.arena.name}")
        engine_cfg = {"kind": cfg.engine_kind, "log_level": cfg.log_level, "fake": cfg.fake or {},
                      "engine": vars(cfg.engine_config(cfg.model))}
        self.link = EngineLink(self.run_dir, engine_cfg, self.arena, cfg.tick_deadline_s, cfg.faults,
                               cfg.pipeline_depth, cfg.start_timeout_s, cfg.restart_timeout_min_s,
                               claim=self.reaper.claim)
        self.link.start()
        info = self.link.wait_ready(lambda: signals.received > 0)
        if info is None:
            raise StartStopped("stopped by a signal during start-up")
        if info.n_vocab != self.tok.n_vocab:  # the file changed between the two loads
            raise RuntimeError(f"the engine's model has {info.n_vocab} tokens, the front's tokenizer "
                               f"{self.tok.n_vocab}: {cfg.model} changed while the node started")
        mb = lambda v: None if v is None else int(v * 2**20)  # noqa: E731
        self.budget = NodeBudget.from_engine(
            info, max_active=cfg.max_active, max_queue=cfg.max_queue, max_batch_size=cfg.max_batch,
            max_prefill_tokens_per_tick=cfg.prefill_chunk, kv_budget_bytes=mb(cfg.kv_budget_mb),
            weight_budget_bytes=mb(cfg.weight_budget_mb), memory_floor_bytes=mb(cfg.memory_floor_mb))
        self.recipe = info.recipe
        self.sched = Scheduler(self.budget, info.eog or [info.eos], recipe=info.recipe)
        self.telemetry = Telemetry(self.sched)
        curve = Curve(cfg.curve_secret_key, cfg.curve_allow_dir) if cfg.curve_secret_key else None
        self.router = client_router(self.zctx, self.listen, curve, cfg.insecure, self._auth)
        self.outbox = Outbox(self.router)
        self.pub = telemetry_pub(self.zctx, self.telemetry_ep, curve, cfg.insecure, self._auth)
        self.gates = [Gate(self.router, self.listen, self.max_clients),
                      Gate(self.pub, self.telemetry_ep, TELEMETRY_SUBSCRIBERS)]
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self.texts.fileno(), zmq.POLLIN)
        for gate in self.gates:
            self._poller.register(gate.monitor, zmq.POLLIN)
        self._watching_clients, self._metrics_fds = True, set()
        if cfg.metrics_listen:
            from meshnode.front.metrics import MetricsServer
            check_private(f"tcp://{cfg.metrics_listen}", "metrics", False, cfg.insecure)
            self.metrics = MetricsServer(cfg.metrics_listen)
            self.metrics.publish(self._snapshot())
        b = self.budget
        log.info("meshnode ready: listen=%s telemetry=%s model=%s recipe=%s engine_pid=%d "
                 "max_active=%d max_queue=%d max_batch=%d prefill_chunk=%d kv_budget=%d B (%d B/token) "
                 "ctx_per_seq=%d weights=%d B%s", self.listen, self.telemetry_ep, cfg.model, self.recipe,
                 info.pid, b.effective_active_cap, b.max_queue, b.max_batch_size, b.max_prefill_tokens_per_tick,
                 b.kv_budget_bytes, b.kv_bytes_per_token, b.n_ctx_seq, b.weight_bytes,
                 f" metrics=http://{cfg.metrics_listen}/metrics" if cfg.metrics_listen else "")
        gc.freeze()  # what start-up built lives as long as the node: keep it out of every collection
        self.notifier.notify("READY=1", f"STATUS={self._status_line()}")

    # -- loop ---------------------------------------------------------------------------
    def loop(self) -> None:
        next_publish = next_status = time.monotonic()
        drain_deadline = None
        while not self.stopping:
            now = time.monotonic()
            if signals.received and drain_deadline is None:
                drain_deadline = self._begin_drain(now)
            if signals.received > 1 or (drain_deadline and (now >= drain_deadline or not self.sched.live)):
                self._send(self.sched.end_all(R.DRAINED))
                self.stopping = True
                break
            self._poll(timeout_ms=max(0, min(100, int((next_publish - now) * 1e3))))
            now = time.monotonic()
            why = self.link.check(now)
            if why:
                self._send(self._engine_died(why))
            self.link.maybe_restart(now)
            self._dispatch()
            if self.outbox.pending:
                self.outbox.flush()
            if now >= next_publish:
                self._front_rss = rss()  # psutil costs about 80 us: not on every status request
                self._fds_open = open_descriptors()
                snap = self._snapshot()
                self.pub.send_multipart(P.telemetry(snap))
                if self.metrics is not None:
                    self.metrics.publish(snap)
                next_publish = now + PUBLISH_EVERY_S
                if self.link.state != FAILED and self.notifier.watchdog_s:
                    self.notifier.notify("WATCHDOG=1")
            if now >= next_status:
                self.notifier.notify(f"STATUS={self._status_line()}")
                next_status = now + STATUS_EVERY_S

    def _begin_drain(self, now: float) -> float:
        log.info("draining: new sessions refused, %d live get up to %.1f s", len(self.sched.live),
                 self.cfg.drain_timeout_s)
        self.sched.draining = True
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        return now + self.cfg.drain_timeout_s

    def _poll(self, timeout_ms: int) -> None:
        now = time.perf_counter()
        wait = self.share.wait_s(now)
        self._watch(clients=wait == 0)
        if wait:  # out of CPU share: requests wait in the clients' queues; ticks go on
            timeout_ms = min(timeout_ms, max(1, int(wait * 1e3)))
        ready = dict(self._poller.poll(timeout_ms))
        link = self.link.watch
        if link is not None and ready.get(link.fileno()):
            events = self._on_engine(self.link.on_message())
            self._dispatch(after_reply=True)  # refill the pipeline before talking to clients
            self._send(events)
        if ready.get(self.texts.fileno()):
            for job in self.texts.finished():
                self._on_text(job)
        for gate in self.gates:
            if ready.get(gate.monitor):
                gate.on_events()
        if self.metrics is not None:
            self.metrics.expire(time.monotonic())
        if ready.get(self.router) or any(ready.get(fd) for fd in self._metrics_fds):
            # a time slice, not a frame count: a flood of valid but costly requests (maximal token
            # lists, status, scrapes) must leave the engine link its turn, and the decode its CPU
            start = time.perf_counter()
            until = start + min(CLIENT_SLICE_S, self.share.available(start))
            for fd in self._metrics_fds:
                if ready.get(fd):
                    self.metrics.on_ready(fd)
            received = 0
            while time.perf_counter() < until:
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                received += sum(map(len, frames))
                self._on_client(frames[0], frames[1:])
            self.share.spend(time.perf_counter() - start + received * RECEIVE_S_PER_BYTE)

    def _watch(self, clients: bool) -> None:
        """Keep the poller on what matters now: the engine's current link, and the client sockets
        (ZeroMQ and /metrics) only while client work is within its CPU share."""
        link = self.link.watch
        if self._poller_link is not link:  # the engine connected, or a new incarnation started
            if self._link_fd is not None:  # by the number it had: a closed socket's fileno() is -1
                self._poller.unregister(self._link_fd)
            self._link_fd = link.fileno() if link is not None else None
            if link is not None:  # a plain socket: the poller reports it by its fd
                self._poller.register(self._link_fd, zmq.POLLIN)
            self._poller_link = link
        if clients != self._watching_clients:
            self._watching_clients = clients
            self._poller.modify(self.router, zmq.POLLIN if clients else 0)
        want = set(self.metrics.fds()) if self.metrics is not None and clients else set()
        for fd in self._metrics_fds - want:
            self._poller.unregister(fd)
        for fd in want - self._metrics_fds:
            self._poller.register(fd, zmq.POLLIN)
        self._metrics_fds = want

    # -- clients ------------------------------------------------------------------------
    def _on_client(self, ident: bytes, frames: list[bytes]) -> None:
        """Requests of one client are answered in order: while its text is being tokenized, the
        requests it sends after it wait (a cancel must find the session it follows)."""
        held = self.held.get(ident)
        if held is None:
            self._handle(ident, frames)
        elif len(held) < MAX_HELD:
            held.append(frames)
        else:
            self.telemetry.count_bad_frame()
            self._reply(ident, P.error(R.TOO_LARGE, f"{MAX_HELD} requests already wait behind a text of this "
                                       "client that is being tokenized; read the answers before sending more"))

    def _handle(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            req = P.decode_request(frames, self.tok.n_vocab)
        except P.ProtocolError as e:
            self.telemetry.count_bad_frame()
            self._reply(ident, P.error(e.code, e.detail, e.id))
            return
        if isinstance(req, P.Ping):
            self._reply(ident, P.pong())
        elif isinstance(req, P.Status):
            self._reply(ident, P.status(self._node_info(), self._snapshot()))
        elif isinstance(req, P.Cancel):
            ev = self.sched.cancel((ident, req.id))
            if ev is None:
                self._reply(ident, P.error(R.UNKNOWN_SESSION, f"no live session {req.id!r}", req.id))
            else:
                self._send([ev])
        else:
            self._submit(ident, req)

    def _submit(self, ident: bytes, req: P.Submit) -> None:
        if req.tokens is not None:
            return self._admit(ident, req, req.tokens)
        # a text that cannot fit is refused before it is tokenized (the bound costs nothing); the
        # rest is tokenized on the worker thread, and admitted when it is back
        d = self.sched.precheck(Ask((ident, req.id), max(1, self.tok.min_tokens(req.text)), req.max_tokens, req.recipe))
        if not d.accepted:
            return self._refuse(ident, req.id, d.reason, d.detail)
        if not self.texts.submit((ident, req), req.text):
            return self._refuse(ident, req.id, R.REJECTED_QUEUE_FULL,
                                f"the tokenizer's backlog is full ({self.texts.max_backlog_bytes} bytes of text "
                                "wait); retry later or send tokens")
        self.held[ident] = deque()

    def _on_text(self, job) -> None:
        ident, req = job.key
        if job.error:
            self._refuse(ident, req.id, R.REJECTED_BAD_REQUEST, job.error)
        else:
            self._admit(ident, req, job.tokens)
        held = self.held.pop(ident, deque())
        while held:
            self._handle(ident, held.popleft())
            if ident in self.held:  # waiting behind another text now
                self.held[ident].extend(held)
                return

    @staticmethod
    def _session(ident: bytes, req: P.Submit, prompt: list[int]) -> Session:
        return Session((ident, req.id), prompt, req.max_tokens, req.sampling, frozenset(req.stop_tokens),
                       req.ignore_eos, req.recipe)

    def _refuse(self, ident: bytes, id: str, reason: str, detail: str) -> None:
        self.telemetry.count_reject(reason)
        self._reply(ident, P.rejected(id, reason, detail))

    def _admit(self, ident: bytes, req: P.Submit, prompt: list[int]) -> None:
        s = self._session(ident, req, prompt)
        d = self.sched.submit(s)
        if d.accepted:
            self.streams[s.key] = TextStream(self.tok)
            self._reply(ident, P.admitted(req.id, d.reason))
        else:
            self._refuse(ident, req.id, d.reason, d.detail)

    def _send(self, events: list[Event]) -> None:
        for ev in events:
            ident, sid = ev.session.key
            if ev.kind == "tokens":
                stream = self.streams.get(ev.session.key)
                text = stream.feed(ev.tokens) if stream else ""
                self._reply(ident, P.tokens(sid, ev.tokens, text), final=False)
            else:
                stream = self.streams.pop(ev.session.key, None)
                tail = stream.end() if stream else ""
                if tail:  # the end of an incomplete character: streamed pieces add up to done.text
                    self._reply(ident, P.tokens(sid, [], tail), final=False)
                s = ev.session
                self._reply(ident, P.done(sid, ev.reason, s.generated, self.tok.decode(s.generated), s.usage(),
                                          ev.detail))

    def _reply(self, ident: bytes, frames: list[bytes], final: bool = True) -> None:
        """Send to one client. One that stopped reading or vanished loses its sessions, nobody else
        does; each still gets its `done`, kept until it reads again (meshnode/outbox.py)."""
        outcome = self.outbox.send(ident, frames, final)
        if outcome not in (STALLED, GONE):
            return
        mine = [k for k in self.sched.live if k[0] == ident]
        if not mine:
            return
        why = "stopped reading" if outcome == STALLED else "disconnected"
        log.warning("client %s %s: cancelling its %d session(s)", ident.hex(), why, len(mine))
        self.telemetry.client_faults_total += 1
        ended = [self.sched.cancel(k) for k in mine]
        for ev in ended:
            ev.detail = (f"the client {why} (over {CLIENT_HWM} messages unread)" if outcome == STALLED
                         else f"the client {why}")
        self._send(ended)

    # -- engine -------------------------------------------------------------------------
    def _dispatch(self, after_reply: bool = False) -> None:
        """Send ticks until the pipeline is full or there is nothing to do.

        A tick sent to an idle engine that did not just reply is `fresh`: the engine was waiting
        for clients, not for us, so its wait is not counted as front + IPC cost.
        """
        while self.link.can_send:
            plan = self.sched.plan()
            if plan is None:
                return
            self.link.send_tick(plan, fresh=not after_reply and not self.link.inflight)

    def _on_engine(self, reply: tuple[dict, object] | None) -> list[Event]:
        """A tick's reply -> the sessions' events (sent by the caller, after the next dispatch)."""
        if reply is None:
            return []
        msg, plan = reply
        if not msg.get("ok"):
            if msg.get("fatal"):
                return self._engine_died(f"engine reported a fatal error: {msg.get('detail')}")
            log.error("engine refused a plan: %s", msg.get("detail"))
            return self.sched.fail_inflight(R.ENGINE_ERROR)
        try:
            res = L.read_result(msg, plan, self.arena, self.tok.n_vocab)
        except (KeyError, TypeError, ValueError) as e:  # garbage from the engine: restart it, re-prefill
            return self._engine_died(f"engine sent a bad reply: {e}")
        self.telemetry.record_tick(int(msg.get("rss", self.telemetry.engine["rss_bytes"])), res.step_ms,
                                   res.kv_cells, float(msg.get("gap_ms", -1.0)))
        if "mem" in msg:
            self.telemetry.set_memory(*msg["mem"])
        return self.sched.apply(res)

    def _engine_died(self, why: str) -> list[Event]:
        """Restart with backoff and re-prefill; in a crash loop, end every session instead."""
        self.link.died(why)
        self.sched.engine_restarted()
        if self.link.state != FAILED:
            return []
        self.telemetry.engine["healthy"] = False
        self.sched.engine_down = self.link.last_error
        return self.sched.end_all(R.ENGINE_ERROR)

    # -- reporting ------------------------------------------------------------------------
    def _snapshot(self) -> dict:
        snap = self.telemetry.snapshot()
        snap["engine"].update(pid=self.link.pid, restarts=self.link.restarts)  # the link owns both
        snap["front_rss_bytes"] = self._front_rss
        snap["undeliverable_total"] = self.outbox.dropped_total
        snap["clients_stalled"] = len(self.outbox.pending)
        snap["clients_connected"], snap["subscribers_connected"] = (g.connected for g in self.gates)
        snap["clients_refused_total"] = self.gates[0].refused_total
        snap["fds_open"], snap["fds_limit"] = self._fds_open, self.fd_limit
        snap["healthy"] = self.link.state != FAILED
        snap["model"], snap["recipe"] = os.path.basename(self.cfg.model), self.recipe
        return snap

    def _node_info(self) -> dict:
        return {"version": __version__, "recipe": self.recipe, "model": self.cfg.model,
                "budgets": self.budget.as_dict(), "engine_pid": self.link.pid, "listen": self.listen,
                "telemetry": self.telemetry_ep, "healthy": self.link.state != FAILED,
                "engine_state": self.link.state, "engine_error": self.link.last_error,
                "engine_first_start_s": self.link.first_start_s, "engine_hello_deadline_s": self.link.hello_deadline_s}

    def _status_line(self) -> str:
        t = self._snapshot()
        return (f"active={t['active_sessions']} queued={t['queue_depth']} kv={t['kv_pressure']:.0%} "
                f"decode={t['decode_tokens_per_s']:.0f} tok/s restarts={t['engine']['restarts']}"
                f"{' UNHEALTHY' if self.link.state == FAILED else ''}")

    # -- shutdown -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release everything initialize() got this far, in reverse dependency order."""
        if self.sched is not None and self.sched.live:
            self._send(self.sched.end_all(R.DRAINED))
        steps = [(self.link, "stop"), (self.texts, "close"), *((g, "close") for g in self.gates),
                 (self.router, "close"), (self.pub, "close"),
                 (self.metrics, "close"),
                 *((a, "stop") for a in self._auth), (self.arena, "close"), (self.zctx, "term"),
                 *((lock, "release") for lock in self._locks), (self.tok, "close"), (self.notifier, "close"),
                 (self.reaper, "done")]
        for obj, method in steps:
            if obj is not None:
                getattr(obj, method)()


class StartStopped(Exception):
    """A signal arrived before the node was ready: a clean stop, not a failure."""


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
