"""/metrics in Prometheus text, with prometheus_client: the snapshot's gauges and counters, and histograms
of what clients feel (time to first token, time between tokens, queue time, end to end).

Names follow vLLM's and llama-server's habits (`*_seconds` histograms, `*_total` counters). The figures
routers read also go out under vLLM's own names (ROUTER, below): the Gateway API Inference Extension's
model-server protocol requires `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`, llm-d also
reads `vllm:num_requests_running` and `vllm:cache_config_info`, so those routers pick this node as they
pick a vLLM server (the mapping: docs/operating.md, "Routers"). The loop
renders the text once per telemetry publication and observes latencies as it sends tokens and dones;
no thread touches the registry (docs/architecture.md: a scrape thread would take the loop's GIL).
"""
from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

prometheus_client.disable_created_metrics()  # no *_created samples: a restart shows in uptime

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# name, type, help, how to read it from a snapshot (the counters are the snapshot's totals)
SNAPSHOT = [
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
    ("meshnode_constraint_failures_total", "counter", "Sessions ended BAD_REQUEST: their response_format failed "
     "while generating.", lambda t: t["constraint_failures_total"]),
    ("meshnode_batch_occupancy", "gauge", "Sequences in the last tick's batch.", lambda t: t["batch_occupancy_last"]),
    ("meshnode_batch_occupancy_avg", "gauge", "Mean sequences per tick since start.", lambda t: t["batch_occupancy_avg"]),
    ("meshnode_batch_occupancy_max", "gauge", "Most sequences in one tick since start.", lambda t: t["batch_occupancy_max"]),
    ("meshnode_ticks_total", "counter", "Engine ticks (llama_decode calls) run.", lambda t: t["ticks_total"]),
    ("meshnode_preemptions_total", "counter", "Running sessions sent back to the queue for a better priority "
     "(--scheduling-policy priority); each continues later, re-prefilled.", lambda t: t["preemptions_total"]),
    ("meshnode_bad_frames_total", "counter", "Malformed or oversize client frames.", lambda t: t["bad_frames_total"]),
    ("meshnode_unknown_sessions_total", "counter", "Cancels of ids with no live session.",
     lambda t: t["unknown_sessions_total"]),
    ("meshnode_engine_restarts_total", "counter", "Engine process restarts.", lambda t: t["engine"]["restarts"]),
    ("meshnode_engine_rss_bytes", "gauge", "Engine process resident memory.", lambda t: t["engine"]["rss_bytes"]),
    ("meshnode_engine_last_tick_seconds", "gauge", "Duration of the last engine step.", lambda t: t["engine"]["last_tick_ms"] / 1e3),
    ("meshnode_engine_wait_p50_seconds", "gauge", "Engine's median wait for its next tick (front + IPC), last 1024 ticks.",
     lambda t: t["engine"]["wait_us_p50"] / 1e6),
    ("meshnode_engine_drafted_rows_total", "counter", "Draft tokens verified as rows of their sequence (speculative "
     "decoding).", lambda t: t["engine"]["drafted_rows_total"]),
    ("meshnode_engine_drafts_served_total", "counter", "Tokens answered from drafts an earlier tick verified, with no "
     "llama_decode.", lambda t: t["engine"]["drafts_served_total"]),
    ("meshnode_engine_draft_acceptance_ratio", "gauge", "Drafts served over drafts verified, since start.",
     lambda t: t["engine"]["drafts_served_total"] / max(1, t["engine"]["drafted_rows_total"])),
    ("meshnode_engine_deferred_chunks_total", "counter", "Chunks ticks in flight left undone for a better request's "
     "first token (priority policy), planned again.", lambda t: t["engine"]["deferred_chunks_total"]),
    ("meshnode_engine_healthy", "gauge", "1 while the engine serves, 0 in a crash loop or waiting for an RPC worker.", lambda t: int(t["engine"]["healthy"])),
    ("meshnode_engine_waiting_for_worker", "gauge", "1 while an RPC worker the engine needs does not answer.",
     lambda t: int(bool(t["engine"].get("missing")))),
    ("meshnode_memory_available_bytes", "gauge", "Host or cgroup memory available.", lambda t: t["memory"]["available_bytes"]),
    ("meshnode_memory_pressure_ratio", "gauge", "1 - available / total memory.", lambda t: t["memory"]["pressure"]),
    ("meshnode_draining", "gauge", "1 while the node drains.", lambda t: int(t["draining"])),
    ("meshnode_uptime_seconds", "gauge", "Seconds since the node started.", lambda t: t["uptime_s"]),
]




# vLLM's names for what a router reads, with vLLM's meanings and its `model_name` label
ROUTER = [
    ("vllm:num_requests_running", "Number of requests in model execution batches.", lambda t: t["active_sessions"]),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda t: t["queue_depth"]),
    # the share of the KV budget admission has handed out: what decides whether another request fits (cached
    # prefixes of finished sessions give way to any new one, as vLLM's evictable blocks count as free)
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda t: min(1.0, t["kv_pressure"])),
]


class Exposition:
    """One node's metrics: `observe_*` as sessions stream and end, `render(snapshot)` once a second."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        h = lambda name, doc, buckets: Histogram(name, doc, buckets=buckets, registry=self.registry)  # noqa: E731
        self.ttft = h("meshnode_time_to_first_token_seconds", "From a submit's arrival to its first token.",
                      LATENCY_BUCKETS)
        self.itl = h("meshnode_inter_token_latency_seconds", "Between two tokens of one session, as sent.",
                     LATENCY_BUCKETS)
        self.queue = h("meshnode_request_queue_time_seconds", "From a submit's arrival to its start on the engine.",
                       REQUEST_BUCKETS)
        self.e2e = h("meshnode_e2e_request_latency_seconds", "From a submit's arrival to its done.", REQUEST_BUCKETS)
        self._snap: dict | None = None
        self._model, self._cache = "", {}
        self.registry.register(self)

    def identify(self, model: str, cache: dict) -> None:
        """What does not change while the node runs: the model's name (the `model_name` label) and the KV
        cache's configuration, as `vllm:cache_config_info` labels (strings, as vLLM writes them). (Not named
        `describe`: prometheus_client calls a collector's describe().)"""
        self._model, self._cache = model, {k: str(v) for k, v in cache.items()}

    def observe_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_done(self, usage: dict) -> None:
        """A session's usage (ms, from arrival); one that never started or never got a token has none."""
        if usage.get("ttft_ms"):
            self.ttft.observe(usage["ttft_ms"] / 1e3)
        if usage.get("queue_ms") or usage.get("ttft_ms"):
            self.queue.observe(usage["queue_ms"] / 1e3)
        self.e2e.observe(usage["total_ms"] / 1e3)

    def render(self, snapshot: dict) -> bytes:
        self._snap = snapshot
        return generate_latest(self.registry)

    def collect(self):
        """The snapshot's figures, read when the registry renders (prometheus_client's collector API)."""
        if self._snap is None:
            return
        for name, kind, help_, read in SNAPSHOT:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_, value=read(self._snap))
        for name, help_, read in ROUTER:
            g = GaugeMetricFamily(name, help_, labels=["model_name"])
            g.add_metric([self._model], read(self._snap))
            yield g
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=sorted(self._cache))
        info.add_metric([self._cache[k] for k in sorted(self._cache)], 1)
        yield info
        rejected = CounterMetricFamily("meshnode_requests_rejected_total", "Sessions refused at admission, by reason.",
                                       labels=["reason"])
        for reason, n in sorted(self._snap["rejected_by_reason"].items()):
            rejected.add_metric([reason], n)
        yield rejected
