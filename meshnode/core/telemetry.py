"""Telemetry: one JSON-safe snapshot of the node, and its Prometheus rendering.

Every publication is a full snapshot (never a delta), so a subscriber that
joins late or drops a message loses nothing. Rates come from counters over a
sliding window read off an injectable clock, so tests get exact figures.
"""
from __future__ import annotations

import time
from collections import Counter, deque

from meshnode.core import reasons as R
from meshnode.core.capacity import capacity

RATE_WINDOW_S = 10.0
ESTIMATE_PROMPT_TOKENS = 512  # the prompt size the published capacity block estimates for
WAIT_WINDOW = 1024  # ticks the engine-wait percentiles cover


class Telemetry:
    """The node's counters and the snapshot built from them and the scheduler's public state. What
    other parts own (engine pid, restarts, health, client sockets) the front adds to the snapshot."""

    def __init__(self, scheduler, clock=time.monotonic):
        self.sched = scheduler
        self.clock = clock
        self.t0 = clock()
        self.rejected = Counter()
        self.bad_frames_total = 0
        self.client_faults_total = 0  # clients whose sessions were cancelled because they vanished or stalled
        self.engine = {"rss_bytes": 0, "rss_peak_bytes": 0, "last_tick_ms": 0.0, "kv_cells": 0, "kv_cells_peak": 0,
                       "step_ms_total": 0.0, "busy_gap_ms_total": 0.0, "busy_gaps": 0}
        self.memory = {"available_bytes": 0, "total_bytes": 0, "pressure": 0.0}
        self._samples: deque = deque()
        self._waits: deque = deque(maxlen=WAIT_WINDOW)

    def count_reject(self, reason: str) -> None:
        self.rejected[reason] += 1

    def count_bad_frame(self) -> None:
        self.bad_frames_total += 1

    def record_tick(self, rss: int, step_ms: float, kv_cells: int, gap_ms: float = -1.0) -> None:
        """`gap_ms`: the engine's time between its last step and this one (from that result being
        ready to this step starting), the front + IPC cost of a tick; -1 when the engine was idle
        and the tick is new work (a wait for clients, not us)."""
        e = self.engine
        if gap_ms >= 0:
            e["busy_gap_ms_total"] += gap_ms
            e["busy_gaps"] += 1
            self._waits.append(gap_ms * 1e3)
        e.update(rss_bytes=rss, last_tick_ms=round(step_ms, 3), kv_cells=kv_cells,
                 step_ms_total=e["step_ms_total"] + step_ms,
                 rss_peak_bytes=max(e["rss_peak_bytes"], rss), kv_cells_peak=max(e["kv_cells_peak"], kv_cells))

    def set_memory(self, available: int, total: int) -> None:
        pressure = 1.0 - available / total if total else 0.0
        self.memory = {"available_bytes": int(available), "total_bytes": int(total),
                       "pressure": round(min(1.0, max(0.0, pressure)), 4)}

    def _rates(self, now: float, prefill: int, decode: int) -> tuple[float, float]:
        self._samples.append((now, prefill, decode))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t, p, d = self._samples[0]
        dt = now - t
        return ((prefill - p) / dt, (decode - d) / dt) if dt > 0 else (0.0, 0.0)

    def snapshot(self) -> dict:
        s, now = self.sched, self.clock()
        c, a, b = s.counters, s.admission, s.budget
        prefill_rate, decode_rate = self._rates(now, c.prefill_tokens, c.decode_tokens)
        return {
            "active_sessions": len(s.running),
            "queue_depth": len(s.waiting),
            "batch_occupancy_last": c.occupancy_last,
            "batch_occupancy_avg": round(c.occupancy_sum / c.ticks, 4) if c.ticks else 0.0,
            "batch_occupancy_max": c.occupancy_max,
            "max_batch_size": b.max_batch_size,
            "kv_bytes": a.kv_reserved_bytes,
            "kv_used_bytes": self.engine["kv_cells"] * b.kv_bytes_per_token,
            "kv_used_peak_bytes": self.engine["kv_cells_peak"] * b.kv_bytes_per_token,
            "kv_budget_bytes": b.kv_budget_bytes,
            "kv_pressure": round(a.kv_reserved_bytes / b.kv_budget_bytes, 4),
            "scratch_bytes": a.scratch_reserved_bytes,
            "scratch_budget_bytes": b.scratch_envelope_bytes,
            "scratch_pressure": round(a.scratch_reserved_bytes / b.scratch_envelope_bytes, 4),
            "weight_bytes": b.weight_bytes,
            "prefill_tokens_total": c.prefill_tokens,
            "decode_tokens_total": c.decode_tokens,
            "prefill_tokens_per_s": round(prefill_rate, 3),
            "decode_tokens_per_s": round(decode_rate, 3),
            "ticks_total": c.ticks,
            "rejected_total": sum(self.rejected.values()),
            "rejected_by_reason": {r: self.rejected.get(r, 0) for r in R.REJECTIONS},
            "bad_frames_total": self.bad_frames_total,
            "client_faults_total": self.client_faults_total,
            "engine": dict(self.engine, **self._wait_percentiles()),
            "memory": dict(self.memory),
            "uptime_s": round(now - self.t0, 3),
            "draining": s.draining,
            "prefix_cache": self._cache(),
            "capacity": self.capacity(),
        }

    def capacity(self, prompt_tokens: int | None = None) -> dict:
        n = prompt_tokens or ESTIMATE_PROMPT_TOKENS
        return dict(capacity(self.sched, n), estimate_prompt_tokens=n)

    def _cache(self) -> dict:
        s = self.sched
        k, computed = s.cache.counters, s.counters.prefill_tokens
        return {"scope": s.cache.scope, "entries": len(s.cache.entries),
                "cached_bytes": s.cache.cells * s.budget.kv_bytes_per_token,
                "hits_total": k.hits, "hit_tokens_total": k.hit_tokens, "evictions_total": k.evictions,
                "hit_token_ratio": round(k.hit_tokens / (k.hit_tokens + computed), 4) if computed + k.hit_tokens else 0.0}

    def _wait_percentiles(self) -> dict:
        w = sorted(self._waits)
        pick = lambda q: round(w[min(len(w) - 1, int(q * len(w)))], 1) if w else 0.0  # noqa: E731
        return {"wait_us_p50": pick(0.5), "wait_us_p90": pick(0.9)}


# name, type, help, how to read it from a snapshot
_METRICS = [
    ("meshnode_requests_running", "gauge", "Sessions running on the engine.", lambda t: t["active_sessions"]),
    ("meshnode_requests_waiting", "gauge", "Sessions waiting in the admission queue.", lambda t: t["queue_depth"]),
    ("meshnode_kv_cache_usage_ratio", "gauge", "KV bytes reserved over the KV budget.", lambda t: t["kv_pressure"]),
    ("meshnode_kv_cache_reserved_bytes", "gauge", "KV bytes reserved by active sessions.", lambda t: t["kv_bytes"]),
    ("meshnode_kv_cache_budget_bytes", "gauge", "The node's KV byte budget.", lambda t: t["kv_budget_bytes"]),
    ("meshnode_kv_cache_used_bytes", "gauge", "KV bytes the engine holds (running and cached sequences).",
     lambda t: t["kv_used_bytes"]),
    ("meshnode_prefix_cache_bytes", "gauge", "KV bytes held by finished sessions for reuse.",
     lambda t: t["prefix_cache"]["cached_bytes"]),
    ("meshnode_prefix_cache_entries", "gauge", "Finished sessions whose KV is kept for reuse.", lambda t: t["prefix_cache"]["entries"]),
    ("meshnode_prefix_cache_hits_total", "counter", "Sessions that started on reused KV.", lambda t: t["prefix_cache"]["hits_total"]),
    ("meshnode_prefix_cache_hit_tokens_total", "counter", "Prompt tokens not prefilled thanks to reused KV.",
     lambda t: t["prefix_cache"]["hit_tokens_total"]),
    ("meshnode_prefix_cache_evictions_total", "counter", "Cached sequences dropped to make room.",
     lambda t: t["prefix_cache"]["evictions_total"]),
    ("meshnode_scratch_usage_ratio", "gauge", "Scratch reserved over the scratch envelope.", lambda t: t["scratch_pressure"]),
    ("meshnode_weight_bytes", "gauge", "Bytes of model weights loaded.", lambda t: t["weight_bytes"]),
    ("meshnode_prompt_tokens_total", "counter", "Prompt tokens prefilled (re-prefills included).", lambda t: t["prefill_tokens_total"]),
    ("meshnode_generation_tokens_total", "counter", "Tokens generated.", lambda t: t["decode_tokens_total"]),
    ("meshnode_batch_occupancy", "gauge", "Sequences in the last tick's batch.", lambda t: t["batch_occupancy_last"]),
    ("meshnode_batch_occupancy_avg", "gauge", "Mean sequences per tick since start.", lambda t: t["batch_occupancy_avg"]),
    ("meshnode_batch_occupancy_max", "gauge", "Most sequences in one tick since start.", lambda t: t["batch_occupancy_max"]),
    ("meshnode_ticks_total", "counter", "Engine ticks (llama_decode calls) run.", lambda t: t["ticks_total"]),
    ("meshnode_bad_frames_total", "counter", "Malformed or oversize client frames.", lambda t: t["bad_frames_total"]),
    ("meshnode_engine_restarts_total", "counter", "Engine process restarts.", lambda t: t["engine"]["restarts"]),
    ("meshnode_engine_rss_bytes", "gauge", "Engine process resident memory.", lambda t: t["engine"]["rss_bytes"]),
    ("meshnode_engine_last_tick_seconds", "gauge", "Duration of the last engine step.", lambda t: t["engine"]["last_tick_ms"] / 1e3),
    ("meshnode_engine_wait_p50_seconds", "gauge", "Engine's median wait for its next tick (front + IPC), last 1024 ticks.",
     lambda t: t["engine"]["wait_us_p50"] / 1e6),
    ("meshnode_engine_healthy", "gauge", "1 while the engine serves, 0 in a crash loop.", lambda t: int(t["engine"]["healthy"])),
    ("meshnode_memory_available_bytes", "gauge", "Host or cgroup memory available.", lambda t: t["memory"]["available_bytes"]),
    ("meshnode_memory_pressure_ratio", "gauge", "1 - available / total memory.", lambda t: t["memory"]["pressure"]),
    ("meshnode_draining", "gauge", "1 while the node drains.", lambda t: int(t["draining"])),
    ("meshnode_uptime_seconds", "gauge", "Seconds since the node started.", lambda t: t["uptime_s"]),
]


def to_prometheus(snap: dict) -> str:
    """Prometheus text exposition (version 0.0.4) of one snapshot."""
    out = []
    for name, kind, help_, read in _METRICS:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {read(snap)}"]
    name = "meshnode_requests_rejected_total"
    out += [f"# HELP {name} Sessions refused at admission, by reason.", f"# TYPE {name} counter"]
    out += [f'{name}{{reason="{r}"}} {n}' for r, n in sorted(snap["rejected_by_reason"].items())]
    return "\n".join(out) + "\n"
