"""What the node tells the world, and when: the full snapshot, status, sd_notify, on a timer.

The snapshot is the telemetry's counters plus what other parts own: the
engine's pid and restarts and the node's health (meshnode/core/health.py),
the client sockets' figures, the front's own memory and descriptors. It is
published at least once a second on the PUB and to /metrics; systemd gets a
STATUS line every few seconds and WATCHDOG only while the engine is healthy
(a node waiting for an RPC worker is unhealthy to clients but keeps its
watchdog: restarting it would not bring the worker back).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from ipc import events as E
from meshnode import __version__
from meshnode.core import speculation
from meshnode.core.kvevents import BLOCK_TOKENS
from meshnode.front.gate import open_descriptors
from meshnode.ops.memory import rss

PUBLISH_EVERY_S = 1.0
STATUS_EVERY_S = 5.0


@dataclass
class Sources:
    """What the report reads, each owned elsewhere in the front."""
    cfg: object  # NodeConfig
    telemetry: object  # core Telemetry: counters and the scheduler's state
    link: object  # EngineLink: the engine's pid
    health: object  # EngineHealth
    clients: object  # Clients: sockets' figures, publication
    texts: object  # TextJobs: the tokenizer's backlog
    notifier: object  # sd_notify
    budget: object
    recipe: str
    listen: str
    telemetry_ep: str
    fd_limit: int
    deterministic: bool  # in effect (the engine's start-up check may have turned it off)
    devices: tuple = ()  # core Device: where the first incarnation's llama.cpp put the model
    tool_format: str = "generic"  # how the chat template has the model call tools (text/jinja.py)


class Report:
    def __init__(self, sources: Sources):
        self.src = sources
        self.front_rss, self.fds_open = rss(), 0
        self.next_publish = self.next_status = 0.0

    def snapshot(self) -> dict:
        n = self.src
        snap = n.telemetry.snapshot()
        snap["engine"].update(pid=n.link.pid, restarts=n.health.restarts, healthy=n.health.serving,
                              missing=n.health.missing)
        snap.update(n.clients.stats())
        snap["front_rss_bytes"], snap["fds_open"], snap["fds_limit"] = self.front_rss, self.fds_open, n.fd_limit
        snap["tokenizer_jobs_total"], snap["tokenizer_backlog_chars"] = n.texts.jobs_total, n.texts.backlog_chars
        snap["healthy"] = n.health.serving
        snap["model"], snap["recipe"] = os.path.basename(n.cfg.model), n.recipe
        snap["deterministic"], snap["kv_layout"] = n.deterministic, n.cfg.layout
        return snap

    def status(self, prompt_tokens: int | None = None, ident: bytes | None = None) -> list[bytes]:
        """The `status` event: node info, the snapshot, and the capacity for a prompt of that size."""
        n, h = self.src, self.src.health
        info = {"version": __version__, "recipe": n.recipe, "model": n.cfg.model, "budgets": n.budget.as_dict(),
                "engine_pid": n.link.pid, "listen": n.listen, "telemetry": n.telemetry_ep, "healthy": h.serving,
                "engine_state": h.state, "engine_error": h.last_error, "engine_first_start_s": h.first_start_s,
                "engine_hello_deadline_s": h.hello_deadline_s, "deterministic": n.deterministic,
                "deterministic_problem": n.link.info.deterministic_problem if n.link.info else "",
                "kernels": n.link.info.kernels if n.link.info else "",
                "kv_layout": n.cfg.layout, "prefix_cache": n.cfg.prefix_cache, "engine_missing": h.missing,
                "gather_ms": n.cfg.gather_ms, "max_clients_per_host": n.cfg.max_clients_per_host,
                "cache_type_k": n.cfg.type_k, "cache_type_v": n.cfg.type_v, "kv_bytes_per_token": n.budget.kv_bytes_per_token,
                "devices": [asdict(d) for d in n.devices]}
        info["spec"], info["spec_problem"] = speculation.in_effect(n.cfg.spec, n.cfg.layout)
        info["draft_max"], info["draft_min"], info["tool_format"] = n.cfg.draft_max, n.cfg.draft_min, n.tool_format
        info["pooling"] = n.cfg.pooling
        snap = self.snapshot()  # its capacity block is the estimate for the default prompt size
        cap = snap["capacity"] if prompt_tokens is None else n.telemetry.capacity(prompt_tokens)
        # the prefix cache's blocks, keyed as its KV events key them (core/kvevents.py): what a router that
        # did not follow the events (or lost some) starts from; a client sees only the blocks it could reuse
        held = sorted(n.telemetry.sched.cached_blocks(ident))
        return E.status(info, snap, {**cap, "cached_blocks": {"block_size": BLOCK_TOKENS, "hashes": held}})

    def status_line(self) -> str:
        t = self.snapshot()
        return (f"active={t['active_sessions']} queued={t['queue_depth']} kv={t['kv_pressure']:.0%} "
                f"decode={t['decode_tokens_per_s']:.0f} tok/s restarts={t['engine']['restarts']}"
                f"{'' if t['healthy'] else ' UNHEALTHY'}"
                f"{' WAITING ' + t['engine']['missing'] if t['engine']['missing'] else ''}")

    def due(self, now: float) -> float:
        """Publish and notify what is due; return seconds until the next publication."""
        n = self.src
        if now >= self.next_publish:
            self.front_rss, self.fds_open = rss(), open_descriptors()  # psutil and /proc: not per request
            n.clients.publish(self.snapshot())
            self.next_publish = now + PUBLISH_EVERY_S
            if n.health.healthy and n.notifier.watchdog_s:
                n.notifier.notify("WATCHDOG=1")
        if now >= self.next_status:
            n.notifier.notify(f"STATUS={self.status_line()}")
            self.next_status = now + STATUS_EVERY_S
        return self.next_publish - now


def ready_line(src: Sources, max_clients: int) -> str:
    """The log line that says the node serves, and with what (every budget, where the model is)."""
    cfg, b, info = src.cfg, src.budget, src.link.info
    return (f"meshnode ready: listen={src.listen} telemetry={src.telemetry_ep} model={cfg.model} recipe={src.recipe} "
            f"engine_pid={src.link.pid} max_active={b.effective_active_cap} max_queue={b.max_queue} "
            f"max_batch={b.max_batch_size} prefill_chunk={b.max_prefill_tokens_per_tick} kv_budget={b.kv_budget_bytes} B "
            f"({b.kv_bytes_per_token} B/token, K {cfg.type_k}, V {cfg.type_v}) ctx_per_seq={b.n_ctx_seq} "
            f"weights={b.weight_bytes} B max_clients={max_clients} kv_layout={cfg.layout} "
            f"deterministic={_deterministic_line(info)} devices={_devices_line(info.devices)} "
            f"kernels={info.kernels.replace(' ', '_') or 'unknown'}"
            + (f" metrics=http://{cfg.metrics_listen}/metrics" if cfg.metrics_listen else ""))


def _deterministic_line(info) -> str:
    """on, or off and why in the engine's words (the default's choice, a format or CPU it does not hold on)."""
    return "on" if info.deterministic else f"off ({info.deterministic_problem or 'turned off'})"


def _devices_line(devices) -> str:
    """Where the model is, for the ready line: CPU[0-1],RPC0@10.0.0.2:50052[2-4]."""
    def span(layers):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else "".join(map(str, layers))
    return ",".join(f"{d.name}{'@' + d.endpoint if d.endpoint else ''}[{span(d.layers)}]" for d in devices) or "CPU"
