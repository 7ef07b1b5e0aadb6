"""Admission, budgets and the continuous-batching scheduler, driven by a fake engine."""
import pytest

from helpers import Clock, done_reasons, engine_config, outputs, run_tick, run_to_completion, scheduler, session, step
from meshnode.core import reasons as R
from meshnode.core.budget import NodeBudget
from meshnode.core.sizing import TickTarget
from meshnode.core.pipeline import TickPipeline
from meshnode.core.types import ConfigError
from meshnode.core.session import Session
from meshnode.dev.fake import FakeEngine


def node(max_active=2, max_queue=2, prefill=8, engine=None, **kw):
    """The node's policy with the rules these tests count made plain: a token a tick (no multi-step), the
    budget's prefill bound every tick (no tick target), every finish releasing its KV (no prefix cache)."""
    kw = {"steps_ms": 0.0, "tick_target": TickTarget(), "prefix_cache": "off", **kw}
    return scheduler(engine, max_active=max_active, max_queue=max_queue, max_prefill_tokens_per_tick=prefill, **kw)


sess = session


def test_fill_slots_then_queue_then_reject_then_recover():
    e, s = node(max_active=2, max_queue=2)
    got = [s.submit(sess(i)).reason for i in range(5)]
    assert got == [R.ADMITTED, R.ADMITTED, R.QUEUED, R.QUEUED, R.REJECTED_QUEUE_FULL]
    assert len(s.running) == 2 and len(s.waiting) == 2
    ends = done_reasons(run_to_completion(s, e, 200))
    assert ends == {0: R.LENGTH, 1: R.LENGTH, 2: R.LENGTH, 3: R.LENGTH}
    assert s.submit(sess(9)).reason == R.ADMITTED  # recovered
    run_to_completion(s, e, 200)
    assert s.admission.kv_reserved_bytes == 0 and s.admission.scratch_reserved_bytes == 0


def test_clients_take_turns_in_the_queue_and_a_full_queue_gives_way_from_the_busiest():
    """One client's burst (a /v1/embeddings of 256 inputs is 256 submits) holds one place ahead of another
    client's request, not all of them: the newcomer is queued second and starts right after the burst's
    first; alone, a client's requests keep their order."""
    e, s = node(max_active=1, max_queue=6)
    assert s.submit(sess("a0", owner="a")).reason == R.ADMITTED
    for i in range(1, 6):
        s.submit(sess(f"a{i}", owner="a"))
    assert s.submit(sess("b0", owner="b")).detail == "queued at position 2"
    assert [q.key for q in s.waiting] == ["a1", "b0", "a2", "a3", "a4", "a5"]
    s.submit(sess("b1", owner="b", priority=0))  # the queue is full: fcfs refuses, as before
    assert [q.key for q in s.waiting][-1] == "a5"
    started = [ev.session.key for ev in run_to_completion(s, e, 400) if ev.kind == "done"]
    assert started[:3] == ["a0", "a1", "b0"] and started[3:] == ["a2", "a3", "a4", "a5"]


def test_permanent_misfits_are_rejected_with_their_own_reason():
    e, s = node(kv_budget_bytes=1024 * 400, scratch_envelope_bytes=8 * 512 + 8 * 300, max_active=1)
    assert s.submit(sess("kv", n_prompt=390, max_tokens=20)).reason == R.REJECTED_KV_BUDGET
    assert s.submit(sess("ctx", n_prompt=4000, max_tokens=200)).reason == R.REJECTED_CONTEXT_TOO_LONG
    assert s.submit(sess("scratch", n_prompt=300, max_tokens=20)).reason == R.REJECTED_SCRATCH_BUDGET
    assert s.submit(sess("ok", n_prompt=10, max_tokens=10)).reason == R.ADMITTED
    assert s.submit(sess("ok")).reason == R.REJECTED_DUPLICATE
    assert s.submit(sess("r", recipe="other")).reason == R.REJECTED_RECIPE_MISMATCH
    assert s.submit(Session("empty", [], 3)).reason == R.REJECTED_BAD_REQUEST
    _, low = node(memory_floor_bytes=1 << 20)
    low.mem_available = 10  # as the engine's psutil report would set it
    assert low.submit(sess("mem")).reason == R.REJECTED_MEMORY_PRESSURE
    s.draining = True
    assert s.submit(sess("late")).reason == R.REJECTED_DRAINING


def test_budget_reports_weights_and_refuses_what_cannot_work():
    e = FakeEngine(weight_bytes=5000)
    b = NodeBudget.from_engine(e)
    assert b.weight_bytes == 5000 and b.as_dict()["effective_active_cap"] == 8
    with pytest.raises(ConfigError, match="weight"):
        NodeBudget.from_engine(e, weight_budget_bytes=4000)
    with pytest.raises(ConfigError, match="below one token"):
        NodeBudget.from_engine(e, kv_budget_bytes=10)
    with pytest.raises(ConfigError, match="max_active"):
        NodeBudget.from_engine(e, max_active=0)
    with pytest.raises(ConfigError, match="max_prefill_tokens_per_tick"):
        NodeBudget.from_engine(e, max_prefill_tokens_per_tick=-3)
    assert NodeBudget.from_engine(e, scratch_envelope_bytes=3 * 4096).effective_active_cap == 3


def test_kv_reservation_limits_concurrency_and_returns_to_zero():
    e, s = node(max_active=8, max_queue=8, kv_budget_bytes=1024 * 30)
    reasons = [s.submit(sess(i, n_prompt=5, max_tokens=5)).reason for i in range(4)]
    assert reasons == [R.ADMITTED, R.ADMITTED, R.ADMITTED, R.QUEUED]  # 3 x 10 tokens fill 30
    assert s.admission.kv_reserved_bytes == 30 * 1024
    run_to_completion(s, e, 100)
    assert s.admission.kv_reserved_bytes == 0


def test_cancel_frees_the_reservation_and_releases_the_sequence_next_plan():
    e, s = node()
    s.submit(sess("a", max_tokens=50))
    run_tick(s, e)
    seq = s.live["a"].seq_id
    ev = s.cancel("a")
    assert ev.reason == R.CANCELLED and s.admission.kv_reserved_bytes == 0
    assert s.plan().plan.release == [seq]
    assert s.cancel("a") is None


def test_decode_first_and_prefill_bound():
    e, s = node(max_active=5, max_queue=0, prefill=8)
    s.submit(sess("live", n_prompt=2, max_tokens=40))
    run_tick(s, e)  # prompt in; now decoding
    for i in range(4):
        assert s.submit(sess(f"burst{i}", n_prompt=30, max_tokens=3)).reason == R.ADMITTED
    tick = s.plan()
    assert tick.plan.chunks[0].seq_id == s.live["live"].seq_id and len(tick.plan.chunks[0].tokens) == 1  # decode first
    step(s, e, tick)
    decoded_every_tick = True
    while any(x.pending > 1 for x in s.running):
        before = s.counters.prefill_tokens
        tick = s.plan()
        assert 0 < s.counters.prefill_tokens - before <= 8
        decoded_every_tick &= any(c.seq_id == s.live["live"].seq_id for c in tick.plan.chunks)
        step(s, e, tick)
    assert decoded_every_tick


def test_huge_prompt_progresses_with_a_one_token_budget():
    e, s = node(prefill=1)
    s.submit(sess("big", n_prompt=50, max_tokens=2))
    ends = done_reasons(run_to_completion(s, e, 60))
    assert ends == {"big": R.LENGTH}


def test_batched_decode_matches_serialized_and_occupancy_reaches_four():
    lengths = [1, 3, 7, 12]
    e, s = node(max_active=4, max_queue=0)
    for i, n in enumerate(lengths):
        s.submit(Session(i, [3 + (i * 13 + k) % 400 for k in range(n)], 12))
    batched = outputs(run_to_completion(s, e, 100))
    assert s.counters.occupancy_max == 4
    for i, n in enumerate(lengths):
        e2, s2 = node(max_active=1)
        s2.submit(Session(i, [3 + (i * 13 + k) % 400 for k in range(n)], 12))
        alone = [ev.tokens for ev in run_to_completion(s2, e2, 100) if ev.kind == "done"][0]
        assert batched[i] == alone
    assert len({tuple(t) for t in batched.values()}) == 4  # divergent sessions


def test_endings_eos_stop_and_ignore_eos():
    e = FakeEngine(n_seq_max=4)
    _, s = node(engine=e, max_active=4)
    s.submit(sess("stop", max_tokens=30))
    run_tick(s, e)
    first = s.live["stop"].generated[0]
    e2, s2 = node(engine=FakeEngine(n_seq_max=4, eos=first), max_active=4)
    s2.submit(sess("eos", max_tokens=30))
    s2.submit(sess("ign", max_tokens=3, ignore_eos=True))
    e3, s3 = node(max_active=4)
    s3.submit(sess("stop", max_tokens=30, stop_tokens=frozenset({first})))
    assert done_reasons(run_to_completion(s2, e2, 50)) == {"eos": R.EOS, "ign": R.LENGTH}
    assert done_reasons(run_to_completion(s3, e3, 50)) == {"stop": R.STOP}


def test_engine_restart_reprefills_with_identical_tokens():
    e, s = node(max_active=3)
    for i in range(3):
        s.submit(sess(i, n_prompt=5 + i, max_tokens=12))
    want = outputs(run_to_completion(s, e, 100))
    e, s = node(max_active=3)
    for i in range(3):
        s.submit(sess(i, n_prompt=5 + i, max_tokens=12))
    for _ in range(6):
        run_tick(s, e)
    s.plan()  # a tick in flight when the engine dies
    e = FakeEngine(n_seq_max=8, n_ctx=4096)  # the restarted engine: empty KV
    s.engine_restarted()
    got = outputs(run_to_completion(s, e, 100))
    assert got == want


def test_cache_miss_ends_the_session_and_frees_kv():
    e, s = node()
    s.submit(sess("a", max_tokens=10))
    tick = s.plan()
    res = e.step(tick.plan)
    res.cache_miss, res.tokens = [tick.plan.chunks[0].seq_id], {}
    assert done_reasons(s.apply(tick, res)) == {"a": R.CACHE_MISS}
    # the engine dropped the sequence already; releasing it once more keeps a new session on the
    # same id from being dropped as a follow-up of the miss when ticks are pipelined
    released = s.plan()
    assert s.admission.kv_reserved_bytes == 0 and released.plan.release == [tick.plan.chunks[0].seq_id]
    assert s.plan() is None


def test_usage_times_come_from_the_clock():
    clock = Clock()
    e, s = scheduler(clock=clock, max_active=1)
    s.submit(sess("a", max_tokens=2))
    s.submit(sess("b", max_tokens=2))
    clock.t += 1.0
    evs = []
    while not s.idle:
        clock.t += 0.5
        evs += run_tick(s, e)
    usage = {ev.session.key: ev.session.usage() for ev in evs if ev.kind == "done"}
    assert usage["a"]["queue_ms"] == 0 and usage["a"]["ttft_ms"] == 1500.0
    assert usage["b"]["queue_ms"] > 0 and usage["b"]["completion_tokens"] == 2


def test_run_to_completion_is_bounded():
    e, s = node()
    s.submit(sess("long", max_tokens=1000))
    with pytest.raises(RuntimeError, match="still live"):
        run_to_completion(s, e, max_ticks=5)


def test_real_engine_batched_sessions_equal_serialized(tiny_model):
    """The scheduler over the real tiny-model engine: 4 divergent sessions, prompts 1/3/7/12."""
    from meshnode.engine.llama import LlamaEngine

    lengths = [1, 3, 7, 12]
    with LlamaEngine(engine_config(tiny_model, n_seq_max=4, ctx=1024, threads=1)) as e:
        def run(keys, max_active):
            # one engine under several schedulers: none may leave KV cached that the next one does not know
            _, s = scheduler(e, max_active=max_active, max_prefill_tokens_per_tick=5, prefix_cache="off")
            for i in keys:
                s.submit(Session(i, [3 + (i * 13 + k) % 400 for k in range(lengths[i])], 10, ignore_eos=True))
            out = outputs(run_to_completion(s, e, 200))
            return out, s.counters.occupancy_max

        batched, occupancy = run(range(4), 4)
        assert occupancy == 4
        for i in range(4):
            assert batched[i] == run([i], 1)[0][i]
    assert len({tuple(t) for t in batched.values()}) == 4


def test_a_refused_plan_ends_its_sessions_and_keeps_its_releases():
    e, s = node(max_active=2, max_queue=2)
    s.submit(sess("a", max_tokens=20))
    run_tick(s, e)
    s.cancel("a")  # its sequence is to be released with the next plan
    s.submit(sess("b", max_tokens=50))
    s.submit(sess("c", max_tokens=50))
    pipeline = TickPipeline(1)  # the tick driver's (front/ticks.py): it marks the tick after a refusal
    tick = pipeline.push(s.plan())
    assert tick.plan.release  # the release rides on the plan that the engine now refuses
    ends = done_reasons(s.refused(pipeline.answer(tick.t), R.ENGINE_ERROR, pipeline.refused()))
    assert ends == {"b": R.ENGINE_ERROR, "c": R.ENGINE_ERROR}
    again = pipeline.push(s.plan())
    assert set(tick.plan.release) <= set(again.plan.release) and again.resync
    step(s, e, again)
    s.submit(sess("d", max_tokens=3))
    assert done_reasons(run_to_completion(s, e, 20)) == {"d": R.LENGTH}  # ids are not poisoned


def test_any_end_of_generation_token_ends_with_eos():
    e = FakeEngine()
    _, s = node(engine=e, max_active=2)
    s.submit(sess("probe", max_tokens=3))
    run_tick(s, e)
    first = s.live["probe"].generated[0]
    e2 = FakeEngine()
    e2.eog = [e2.eos, first]  # e.g. EOS and an end-of-turn token
    _, s2 = scheduler(e2)
    s2.submit(sess("chat", max_tokens=30))
    assert done_reasons(run_to_completion(s2, e2, 50)) == {"chat": R.EOS}


def test_an_engine_in_a_crash_loop_refuses_new_work():
    e, s = node()
    s.engine_down = "engine process exited (code 3)"
    d = s.submit(sess("x"))
    assert d.reason == R.REJECTED_ENGINE_UNAVAILABLE and "code 3" in d.detail


def test_progress_events_tell_each_prompt_chunk_before_the_first_token():
    e, sched = scheduler(max_prefill_tokens_per_tick=16, tick_target=TickTarget())
    s = session("p", n_prompt=40, max_tokens=2, progress=True)
    quiet = session("q", n_prompt=40, max_tokens=2, salt=1)
    assert sched.submit(s).accepted and sched.submit(quiet).accepted
    events = []
    while sched.live:
        events += step(sched, e, sched.plan())
    mine = [(ev.kind, ev.progress) for ev in events if ev.session is s and ev.kind in ("progress", "tokens")]
    reports = [p for k, p in mine if k == "progress"]
    assert reports[0] == (40, 0, 0) and reports[-1] == (40, 0, 40)
    assert [p[2] for p in reports] == sorted(p[2] for p in reports) and len(reports) >= 3  # 40 tokens, chunks of 16
    assert mine.index(("tokens", None)) == len(reports)  # every report before the first token
    assert not any(ev.kind == "progress" for ev in events if ev.session is quiet)
