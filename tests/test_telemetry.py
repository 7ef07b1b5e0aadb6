"""Telemetry snapshot keys, deterministic rates, and the Prometheus exposition."""
import json
import re

from helpers import Clock, assert_routable, run_tick, run_to_completion, scheduler
from meshnode.core.session import Session
from meshnode.core.telemetry import Telemetry
from meshnode.front.prom import Exposition


def to_prometheus(snap):
    e = Exposition()
    e.identify("m.gguf", {"block_size": 16, "num_gpu_blocks": 4, "cache_dtype": "f16"})
    return e.render(snap).decode()

# every key docs/protocol.md lists
PROTOCOL_KEYS = """active_sessions queue_depth batch_occupancy_last batch_occupancy_avg batch_occupancy_max
kv_bytes kv_budget_bytes kv_pressure scratch_bytes scratch_budget_bytes scratch_pressure weight_bytes
prefill_tokens_total decode_tokens_total prefill_tokens_per_s decode_tokens_per_s ticks_total rejected_total
rejected_by_reason bad_frames_total unknown_sessions_total engine memory uptime_s draining""".split()


def telemetry():
    clock = Clock(50.0)
    e, s = scheduler(clock=clock, max_active=2, max_queue=1, steps_ms=0.0)  # a token a tick, as counted here
    return clock, e, s, Telemetry(s, clock=clock)


def test_snapshot_has_every_protocol_key_and_is_json_safe():
    clock, e, s, t = telemetry()
    snap = t.snapshot()
    assert set(PROTOCOL_KEYS) <= set(snap)
    assert set(snap["engine"]) >= {"rss_bytes", "last_tick_ms"}  # the front adds pid, restarts, healthy
    assert set(snap["memory"]) >= {"available_bytes", "total_bytes", "pressure"}
    assert json.loads(json.dumps(snap)) == snap


def test_rates_are_deterministic_under_an_injected_clock():
    clock, e, s, t = telemetry()
    t.snapshot()
    s.submit(Session("a", [3] * 10, 4))
    for _ in range(5):
        run_tick(s, e)
    clock.t += 2.0
    snap = t.snapshot()
    assert snap["prefill_tokens_total"] == 10 and snap["decode_tokens_total"] == 4
    assert snap["prefill_tokens_per_s"] == 5.0 and snap["decode_tokens_per_s"] == 2.0
    assert snap["uptime_s"] == 2.0 and snap["ticks_total"] == 4


def test_rejects_and_occupancy_are_counted():
    clock, e, s, t = telemetry()
    for i in range(4):
        d = s.submit(Session(i, [3, 4], 3))
        if not d.accepted:
            t.count_reject(d.reason)
    t.count_bad_frame()
    run_tick(s, e)
    snap = t.snapshot()
    assert snap["rejected_total"] == 1 and snap["rejected_by_reason"]["REJECTED_QUEUE_FULL"] == 1
    assert snap["bad_frames_total"] == 1 and snap["batch_occupancy_max"] == 2
    assert snap["kv_bytes"] == 2 * 5 * e.kv_bytes_per_token and 0 < snap["kv_pressure"] < 1


def test_prometheus_exposition_parses():
    clock, e, s, t = telemetry()
    t.count_reject("REJECTED_QUEUE_FULL")
    snap = t.snapshot()
    snap["engine"].update(pid=1, restarts=0, healthy=True)  # what the front adds
    text = to_prometheus(snap)
    samples = {}
    for line in text.splitlines():
        if line.startswith("vllm:") or re.match(r"# (HELP|TYPE) vllm:", line):
            continue  # the routers' names: below, read as routers read them
        if line.startswith("#"):
            assert re.match(r"# (HELP|TYPE) meshnode_\w+ .+", line)
            continue
        m = re.match(r'^(meshnode_\w+)(\{(reason|le)="([\w.+]+)"\})? (-?[0-9.e+-]+)$', line)
        assert m, line
        samples[(m.group(1), m.group(4))] = float(m.group(5))
    for name in ("meshnode_requests_running", "meshnode_requests_waiting", "meshnode_kv_cache_usage_ratio",
                 "meshnode_prompt_tokens_total", "meshnode_generation_tokens_total", "meshnode_batch_occupancy",
                 "meshnode_engine_restarts_total"):
        assert (name, None) in samples
    assert samples[("meshnode_requests_rejected_total", "REJECTED_QUEUE_FULL")] == 1.0
    assert "# TYPE meshnode_requests_rejected_total counter" in text
    assert assert_routable(text, "m.gguf", running=snap["active_sessions"], waiting=snap["queue_depth"]) == \
        {"block_size": "16", "num_gpu_blocks": "4", "cache_dtype": "f16"}


def test_engine_wait_counts_back_to_back_ticks_only():
    """A fresh tick (-1: the engine was idle, waiting for clients) is not front + IPC cost."""
    clock, e, s, t = telemetry()
    for gap_ms in [0.05, 0.07, 0.08, -1.0, 0.06, 0.09, 0.1, 0.07, 2.0, -1.0, 0.075, 0.065]:
        t.record_tick(1 << 20, 50.0, 10, gap_ms)
    eng = t.snapshot()["engine"]
    assert eng["busy_gaps"] == 10 and abs(eng["busy_gap_ms_total"] - 2.66) < 1e-9
    assert eng["wait_us_p50"] == 75.0 and eng["wait_us_p90"] == 2000.0


def test_prefix_cache_hits_and_saved_tokens_are_reported():
    clock = Clock(50.0)
    e, s = scheduler(clock=clock, prefix_cache="client")
    t = Telemetry(s, clock=clock)
    first = Session("a", [3 + i for i in range(30)], 4, owner="x")
    s.submit(first)
    run_to_completion(s, e)
    s.submit(Session("b", first.tokens + [7, 8], 4, owner="x"))
    run_to_completion(s, e)
    c = t.snapshot()["prefix_cache"]  # b holds 36 prompt + 4 generated tokens, the last never fed
    assert c == {"scope": "client", "entries": 1, "cached_bytes": 39 * e.kv_bytes_per_token,
                 "hits_total": 1, "hit_tokens_total": 33, "evictions_total": 0,
                 "hit_token_ratio": 0.5}  # 33 reused, 30 + 3 computed
    text = to_prometheus(dict(t.snapshot(), engine=dict(t.snapshot()["engine"], pid=1, restarts=0, healthy=True)))
    assert "meshnode_prefix_cache_hit_tokens_total 33" in text
