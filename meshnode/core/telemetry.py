"""Telemetry: one JSON-safe snapshot of the node (front/prom.py renders it for Prometheus).

Every publication is a full snapshot (never a delta), so a subscriber that
joins late or drops a message loses nothing. Rates come from counters over a
sliding window read off an injectable clock, so tests get exact figures.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass

from meshnode.core import reasons as R
from meshnode.core.capacity import capacity


@dataclass
class Counters:
    """What the scheduler counts as it plans and applies ticks; the snapshot reads them."""

    ticks: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    occupancy_last: int = 0
    occupancy_max: int = 0
    occupancy_sum: int = 0
    constraint_failures: int = 0  # sessions ended BAD_REQUEST: their response_format failed while generating
    preemptions: int = 0  # running sessions sent back to the queue for a better priority


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
        self.unknown_sessions_total = 0  # well-formed cancels of ids with no live session
        self.client_faults_total = 0  # clients whose sessions were cancelled because they vanished or stalled
        self.engine = {"rss_bytes": 0, "rss_peak_bytes": 0, "last_tick_ms": 0.0, "kv_cells": 0, "kv_cells_peak": 0,
                       "step_ms_total": 0.0, "busy_gap_ms_total": 0.0, "busy_gaps": 0,
                       "drafted_rows_total": 0, "drafts_served_total": 0, "deferred_chunks_total": 0}
        self.memory = {"available_bytes": 0, "total_bytes": 0, "pressure": 0.0}
        self._samples: deque = deque()
        self._waits: deque = deque(maxlen=WAIT_WINDOW)

    def count_reject(self, reason: str) -> None:
        self.rejected[reason] += 1

    def count_bad_frame(self) -> None:
        self.bad_frames_total += 1

    def count_unknown_session(self) -> None:
        self.unknown_sessions_total += 1

    def record_tick(self, rss: int, step_ms: float, kv_cells: int, gap_ms: float = -1.0, drafted: int = 0,
                    served: int = 0, deferred: int = 0) -> None:
        """`gap_ms`: the engine's time between its last step and this one (from that result being
        ready to this step starting), the front + IPC cost of a tick; -1 when the engine was idle
        and the tick is new work (a wait for clients, not us). `drafted`, `served`: draft tokens verified
        as rows, and ticks answered from right ones with no llama_decode (meshnode/engine/drafts.py);
        `deferred`: chunks a hurried tick left undone (front/ticks.py, hurry)."""
        e = self.engine
        e["deferred_chunks_total"] += deferred
        e["drafted_rows_total"] += drafted
        e["drafts_served_total"] += served
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
            "unknown_sessions_total": self.unknown_sessions_total,
            "constraint_failures_total": c.constraint_failures,
            "preemptions_total": c.preemptions,
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
        k, computed = s.seqs.cache.counters, s.counters.prefill_tokens
        return {"scope": s.seqs.cache.scope, "entries": len(s.seqs.cache.entries),
                "cached_bytes": s.seqs.cells * s.budget.kv_bytes_per_token,
                "hits_total": k.hits, "hit_tokens_total": k.hit_tokens, "evictions_total": k.evictions,
                "hit_token_ratio": round(k.hit_tokens / (k.hit_tokens + computed), 4) if computed + k.hit_tokens else 0.0}

    def _wait_percentiles(self) -> dict:
        w = sorted(self._waits)
        pick = lambda q: round(w[min(len(w) - 1, int(q * len(w)))], 1) if w else 0.0  # noqa: E731
        return {"wait_us_p50": pick(0.5), "wait_us_p90": pick(0.9)}
