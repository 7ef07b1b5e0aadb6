"""The front's client side: its sockets, what it owes stalled clients, and the CPU their requests may take.

One object owns everything clients can reach: the ROUTER for requests, the
telemetry PUB, /metrics, the connection caps on each listener (gate.py), the
answers kept for clients that stopped reading (outbox.py), and the share of
the front's CPU their requests get (meshnode/core/cpushare.py). The loop asks
it what to poll and hands it what was ready; it yields requests to handle,
within the share, and sends answers.
"""
from __future__ import annotations

import time

import zmq

from ipc import events as E
from ipc.transport import Curve, client_router, telemetry_pub
from meshnode.core.cpushare import RECEIVE_S_PER_BYTE, CpuShare
from meshnode.front.gate import EVICT_AFTER_S, Gate
from meshnode.front.metrics import MetricsServer
from meshnode.front.outbox import Outbox
from meshnode.front.prom import Exposition

CLIENT_SLICE_S = 0.004  # client work per loop turn, at most: then the engine link's turn
TELEMETRY_SUBSCRIBERS = 64  # connections the telemetry PUB accepts


class Clients:
    def __init__(self, zctx: zmq.Context, listen: str, telemetry: str, *, curve: Curve | None, insecure: bool,
                 max_clients: int, metrics_listen: str | None = None, busy=None, idle_s: float = 0.0,
                 per_host: int = 0, evict_after_s: float = EVICT_AFTER_S, exposition: Exposition | None = None,
                 kv_events: str | None = None, decoding=None):
        """`busy()`: the client identities with a live session (their connections are never given up);
        `decoding()`: whether sessions are decoding now (only then is client work kept to its CPU share: an idle
        engine has nothing to protect, and an import's KV should come in at the socket's speed);
        `exposition`: what /metrics shows (front/prom.py); `kv_events`: where the prefix cache's KV events go
        (the telemetry's rule: the events carry prompts' token ids)."""
        self._auth: list = []
        self.router = client_router(zctx, listen, curve, insecure, self._auth)
        self.pub = telemetry_pub(zctx, telemetry, curve, insecure, self._auth)
        self.outbox = Outbox(self.router)
        waiting = lambda: (busy() if busy else set()) | set(self.outbox.pending)  # noqa: E731  (answers kept for them)
        self.gates = [Gate(self.router, listen, max_clients, busy=waiting, idle_s=idle_s, per_host=per_host,
                           evict_after_s=evict_after_s),
                      Gate(self.pub, telemetry, TELEMETRY_SUBSCRIBERS)]
        self.kv_pub = None
        if kv_events:
            self.kv_pub = telemetry_pub(zctx, kv_events, curve, insecure, self._auth, what="kv events")
            self.gates.append(Gate(self.kv_pub, kv_events, TELEMETRY_SUBSCRIBERS))
        self._kv_seq = 0
        self.metrics = MetricsServer(metrics_listen) if metrics_listen else None
        self.exposition = exposition or Exposition()
        self.share, self._decoding = CpuShare(time.perf_counter()), decoding or (lambda: True)
        self._watching, self._metrics_fds = True, set()

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self.router, zmq.POLLIN)
        for gate in self.gates:
            poller.register(gate.monitor, zmq.POLLIN)

    def watch(self, poller: zmq.Poller) -> float:
        """Point the poller at the client sockets while requests are within their CPU share; return how
        long until they are again (0 now): meanwhile requests wait in the clients' own queues."""
        wait = self.share.wait_s(time.perf_counter()) if self._decoding() else 0.0
        allowed = wait == 0
        if allowed != self._watching:
            self._watching = allowed
            poller.modify(self.router, zmq.POLLIN if allowed else 0)
        want = set(self.metrics.fds()) if self.metrics is not None and allowed else set()
        for fd in self._metrics_fds - want:
            poller.unregister(fd)
        for fd in want - self._metrics_fds:
            poller.register(fd, zmq.POLLIN)
        self._metrics_fds = want
        return wait

    def requests(self, ready: dict):
        """Yield (identity, frames) of requests waiting, within one slice of the CPU share (scrapes are
        answered on the way); what is left waits for the next turn. `ready`: the client sockets the
        poll found readable."""
        for gate in self.gates:  # every turn: a connection is known before its first request is read
            gate.on_events()
        if not ready.get(self.router) and not any(ready.get(fd) for fd in self._metrics_fds):
            return
        # a time slice, not a count: a flood of valid but costly requests (maximal token lists,
        # status, scrapes) must leave the engine link its turn, and the decode its CPU
        start, metered = time.perf_counter(), self._decoding()
        until = start + (min(CLIENT_SLICE_S, self.share.available(start)) if metered else CLIENT_SLICE_S)
        received = 0
        try:
            for fd in self._metrics_fds:
                if ready.get(fd):
                    self.metrics.on_ready(fd)
            while time.perf_counter() < until:
                try:
                    parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                frames = [p.bytes for p in parts]
                self.gates[0].heard(parts[0].get(zmq.SRCFD), frames[0])
                received += sum(map(len, frames))
                yield frames[0], frames[1:]
        finally:
            if metered:
                self.share.spend(time.perf_counter() - start + received * RECEIVE_S_PER_BYTE)

    def send(self, ident: bytes, frames: list[bytes], final: bool = True) -> str:
        self.gates[0].sent(ident)
        return self.outbox.send(ident, frames, final)

    def flush(self) -> None:
        if self.outbox.pending:
            self.outbox.flush()

    def publish(self, snapshot: dict) -> None:
        """Once a second: the snapshot out, and /metrics connections past their time closed."""
        self.pub.send_multipart(E.telemetry(snapshot))
        self.gates[0].expire()
        if self.metrics is not None:
            self.metrics.publish(self.exposition.render(snapshot))
            self.metrics.expire(time.monotonic())

    def publish_kv(self, events: list[list]) -> None:
        """The prefix cache's events since the last turn, as one batch (none: nothing sent)."""
        if events and self.kv_pub is not None:
            self.kv_pub.send_multipart(E.kv_events(self._kv_seq, time.time(), events))
            self._kv_seq += 1

    def stats(self) -> dict:
        """The snapshot's client figures."""
        router, pub = self.gates[:2]
        return {"clients_stalled": len(self.outbox.pending), "undeliverable_total": self.outbox.dropped_total,
                "clients_connected": router.connected, "subscribers_connected": pub.connected,
                "clients_refused_total": router.refused_total, "clients_evicted_total": router.evicted_total}

    def close(self) -> None:
        for gate in self.gates:
            gate.close()
        for obj in (self.router, self.pub, self.kv_pub):
            if obj is not None:
                obj.close()
        if self.metrics is not None:
            self.metrics.close()
        for auth in self._auth:
            auth.stop()
