"""Pipelined ticks: the front plans tick N+1 while the engine runs tick N.

The promise: pipelining changes when work is planned, never what comes out. Every test compares
against lockstep ticks (plan, run, apply) on the same fake engine, whose next token depends only
on a sequence's own contents, so any token fed at the wrong position or to the wrong sequence
shows up as a different output.
"""
import numpy as np
import pytest

from helpers import Pipelined, run_to_completion
from helpers import scheduler as build
from meshnode.core import reasons as R
from meshnode.core.session import Session
from meshnode.core.types import InvalidPlan, Keep, Plan, Sampling, SeqChunk, Share, StepResult
from meshnode.dev.fake import FakeEngine
from meshnode.engine.followups import AWAITING_RESYNC, Followups


def scheduler(engine, **kw):
    """The node's policy with its KV released at each finish (assert_clean: no prefix cache keeping any)."""
    kw = {"max_active": 5, "max_queue": 20, "max_batch_size": 3, "max_prefill_tokens_per_tick": 16,
          "prefix_cache": "off", **kw}
    return build(engine, **kw)[1]


def sessions(stops=None):
    """Prompts of 1 to 46 tokens, some seeded, some with stop tokens that end them early."""
    out = []
    for i in range(12):
        sampling = Sampling(0.8, 40, 0.95, seed=i) if i % 3 == 0 else Sampling()
        stop = frozenset((stops or {}).get(i, ()))
        out.append(Session(i, [3 + (i * 31 + k * 7) % 500 for k in range(1 + 5 * (i % 10))], 4 + i % 7,
                           sampling, stop_tokens=stop))
    return out


def outcome(events):
    return {e.session.key: (e.reason, e.tokens) for e in events if e.kind == "done"}


def lockstep(make=sessions, **kw):
    e = FakeEngine()
    s = scheduler(e, **kw)
    for x in make():
        s.submit(x)
    return outcome(run_to_completion(s, e))


def pipelined(make=sessions, refuse=(), miss=(), **kw):
    e = FakeEngine()
    s = scheduler(e, **kw)
    for x in make():
        s.submit(x)
    d = Pipelined(s, e, refuse=refuse, miss=miss)
    return outcome(d.run_to_completion()), d, s, e


def started(n_ticks):
    """Sessions submitted, `n_ticks` ticks run through the pipeline, and the pipeline full again."""
    e = FakeEngine()
    s = scheduler(e)
    for x in sessions():
        s.submit(x)
    d, events = Pipelined(s, e), []
    for _ in range(n_ticks):
        d.fill()
        events += d.run_one()
    d.fill()
    return e, s, d, events


def same_except(got, want, keys):
    return {k: v for k, v in got.items() if k not in keys} == {k: v for k, v in want.items() if k not in keys}


def assert_clean(s, e):
    assert not s.live and s.admission.kv_reserved_bytes == 0
    assert e._next_pos == [0] * e.n_seq_max  # every sequence released in the engine too


def test_pipelined_ticks_give_the_lockstep_tokens():
    want = lockstep()
    got, d, s, e = pipelined()
    assert got == want
    assert d.follows > 20  # most decode steps really ran on a sample the front had not seen yet
    assert_clean(s, e)


def test_endings_the_front_cannot_foresee_waste_one_step_and_change_nothing():
    """A stop token is known only when its tick's result is back, and by then the next tick
    (with the session in it) is already queued: that step is computed and thrown away."""
    first = lockstep()
    stops = {i: {toks[1]} for i, (_, toks) in first.items() if i % 2 and len(toks) > 2}
    want = lockstep(lambda: sessions(stops))
    assert {i for i, (r, _) in want.items() if r == R.STOP} == set(stops)
    got, d, s, e = pipelined(lambda: sessions(stops))
    assert got == want
    assert_clean(s, e)


def test_the_last_sample_is_never_fed_back():
    """Length is foreseeable: a session whose final sample is in flight is not planned again."""
    e = FakeEngine()
    s = scheduler(e)
    s.submit(Session("a", [3, 4, 5], 1))
    d = Pipelined(s, e)
    d.fill()
    assert len(d.sent) == 1  # the prompt's tick; nothing to plan on top of it
    got = outcome(d.run_to_completion())
    assert got == lockstep(lambda: [Session("a", [3, 4, 5], 1)]) and got["a"][0] == R.LENGTH
    assert d.pipeline._last_t == 2  # the prompt's tick and the release: no step computed a token nobody wanted


def test_cancel_while_two_ticks_are_in_flight():
    e, s, d, events = started(3)
    assert len(d.sent) == 2
    victim = s.running[0].key
    events.append(s.cancel(victim))
    events += d.run_to_completion()
    got = outcome(events)
    assert got[victim][0] == R.CANCELLED and same_except(got, lockstep(), {victim})
    assert sum(ev.kind == "done" and ev.session.key == victim for ev in events) == 1
    assert_clean(s, e)


def ended_by_fault(reason, **faults):
    """Run with injected faults: the sessions that ended with `reason`, after checking that every
    other session came out exactly as in lockstep and nothing was left behind."""
    got, d, s, e = pipelined(**faults)
    hit = {k for k, (r, _) in got.items() if r == reason}
    assert hit and same_except(got, lockstep(), hit)
    assert_clean(s, e)
    return hit, d


@pytest.mark.parametrize("t", [2, 5, 9])
def test_a_refused_tick_ends_its_sessions_only(t):
    """The queued tick behind the refused one is refused too and planned again after a resync."""
    failed, d = ended_by_fault(R.ENGINE_ERROR, refuse={t})
    assert len(d.refused) == 1  # the ticks after it were planned again, not refused in turn
    assert len(failed) <= len(d.refused[0].chunks)


@pytest.mark.parametrize("t", [1, 4, 8])
def test_a_tick_without_kv_room_ends_its_sessions_only(t):
    ended_by_fault(R.CACHE_MISS, miss={t})


def test_engine_restart_with_ticks_in_flight_reprefills_identically():
    _, s, d, events = started(6)
    assert len(d.sent) == 2
    e = FakeEngine()  # the engine died with two ticks queued: they are lost with it
    s.engine_restarted()
    events += Pipelined(s, e).run_to_completion()
    assert outcome(events) == lockstep()
    assert_clean(s, e)


# -- Followups on their own ------------------------------------------------------------------------
def chunk(seq, pos, toks, draw=-1, follow=False):
    return SeqChunk(seq, pos, np.array(toks, np.int32), draw, follow=follow)


def test_followups_fills_in_the_last_sample():
    c = Followups()
    c.run(FakeEngine(), Plan([chunk(0, 0, [5, 6], draw=0)]))
    plan, dropped = c.resolve(Plan([chunk(0, 2, [-1], draw=1, follow=True)]))
    assert dropped == [] and plan.chunks[0].tokens.tolist() == [c.sampled[0]] and not plan.chunks[0].follow


def test_followups_refuses_a_follow_without_a_sample():
    c = Followups()
    with pytest.raises(InvalidPlan, match="follows a sample"):
        c.resolve(Plan([chunk(0, 2, [-1], draw=1, follow=True)]))


def test_followups_drops_followups_of_a_lost_sequence_but_not_a_new_session_on_it():
    c = Followups()
    c.lost = {0, 1}
    plan, dropped = c.resolve(Plan([chunk(0, 3, [-1], 1, True), chunk(1, 0, [7], 0)], release=[1]))
    assert dropped == [0] and [x.seq_id for x in plan.chunks] == [1]


def test_a_session_meant_to_reuse_kv_the_last_tick_lost_is_dropped_with_its_kv_operation():
    c = Followups()
    c.lost = {0, 2}
    plan, dropped = c.resolve(Plan([chunk(0, 7, [5], 0), chunk(1, 20, [6], 0), chunk(3, 30, [4], 0)],
                                   kv=[Keep(0, 7), Share(2, 1, 20), Share(4, 3, 30)]))
    assert sorted(dropped) == [0, 1] and [x.seq_id for x in plan.chunks] == [3]
    assert plan.kv == [Share(4, 3, 30)]


def test_followups_refuses_everything_until_resync():
    c = Followups()
    c.refused()
    with pytest.raises(InvalidPlan, match=AWAITING_RESYNC[:20]):
        c.resolve(Plan([chunk(0, 0, [5])]))
    plan, _ = c.resolve(Plan([chunk(0, 0, [5])]), resync=True)
    assert len(plan.chunks) == 1 and not c.refusing


def test_run_reports_dropped_sequences_as_misses():
    c = Followups()
    c.lost = {0}

    class Engine:
        def step(self, plan):
            return StepResult(tokens={c_.seq_id: 9 for c_ in plan.chunks})

    res = c.run(Engine(), Plan([chunk(0, 3, [-1], 1, True), chunk(1, 0, [7], 0)]))
    assert res.cache_miss == [0] and res.tokens == {1: 9} and c.lost == {0}


def test_the_next_tick_is_planned_late_in_the_running_one_and_earlier_once_the_engine_waited():
    """A request that arrives while tick N runs joins N+1 if N+1 is planned late in N (not as soon as N is
    sent); planned too late, the engine waits, and the lead grows until it does not."""
    from meshnode.core.pipeline import PLAN_LEAD_MS, Tick, TickPipeline

    p = TickPipeline(depth=2)
    assert p.plan_ahead_at() == 0.0  # nothing runs: plan now
    a = p.push(Tick(0, Plan()))
    a.started_at = 100.0
    assert p.plan_ahead_at() == 0.0  # its time unknown (the cost model not ready): plan now, as before
    a.predicted_ms = 40.0
    assert p.plan_ahead_at() == pytest.approx(100.0 + (40.0 - 0.2 * 40.0) / 1e3)  # a fifth of it ahead
    a.predicted_ms = 5.0
    assert p.plan_ahead_at() == pytest.approx(100.0 + (5.0 - PLAN_LEAD_MS) / 1e3)  # at least the floor
    p.engine_waited(0.1)  # the hand-over every tick has: no change
    assert p.lead_ms == PLAN_LEAD_MS
    p.engine_waited(1.0)  # it waited a millisecond for its tick: plan earlier
    assert p.lead_ms == PLAN_LEAD_MS + 2.0 and p.plan_ahead_at() == pytest.approx(100.0 + 1.0 / 1e3)
    for _ in range(500):  # ticks on time: back to the floor
        p.engine_waited(0.05)
    assert p.lead_ms == PLAN_LEAD_MS
    b = p.push(Tick(0, Plan()))
    b.predicted_ms = 5.0
    assert p.answer(a.t, now=100.006) is a and b.started_at == 100.006  # queued, it runs from a's answer


def test_each_tick_carries_the_cost_models_prediction_once_it_has_one():
    """The scheduler's prediction, which TickPipeline.plan_ahead_at reads: decode ticks by what ticks
    of their rows took (no refit), prompt ticks by the fit."""
    engine = FakeEngine(n_seq_max=8, cost_ms=lambda plan: 4.0 + plan.n_tokens * 0.5)
    sched = scheduler(engine, steps_ms=0.0)  # one step a tick: a tick of three rows is three tokens
    for i in range(3):
        assert sched.submit(Session(i, [3 + i, 4, 5, 6], 30, ignore_eos=True)).accepted
    ticks = []
    while (tick := sched.plan()) is not None:
        ticks.append(tick)
        sched.apply(tick, engine.step(tick.plan))
    assert ticks[0].predicted_ms == 0.0  # nothing measured yet
    decoding = [tk for tk in ticks[5:-1] if len(tk.plan.chunks) == 3]
    assert len(decoding) > 20 and all(tk.predicted_ms == 5.5 for tk in decoding)  # three rows: 4 + 3 x 0.5 ms


def test_an_idle_engine_gathers_requests_sent_together_into_its_first_tick():
    """Requests sent together reach the node spread over a few ms (a gateway parses each): an idle
    engine's first tick waits until they stop coming, a quiet gap, at most GATHER_SPAN gaps, so they start
    together instead of the first alone with the rest behind it. Work in flight is planned as before."""
    from meshnode.core.scheduler import GATHER_SPAN

    from meshnode.front.ticks import Ticks

    class Link:  # the engine process, as far as the driver's timing goes
        can_send = True

        def send(self, tick, fresh):
            pass

    now = [100.0]
    engine, sched = build(FakeEngine(n_seq_max=8), clock=lambda: now[0], max_batch_size=8)
    ticks = Ticks(Link(), 2, None)
    due = lambda: ticks.due(sched.gather_until())  # noqa: E731  (the front's rule: Front._dispatch)
    assert sched.gather_ms == 1.0  # the node's default
    assert due() == 0.0  # nothing came
    sched.submit(Session(0, [3, 4, 5], 4))
    assert due() == pytest.approx(100.001)  # one came: plan once none has for 1 ms
    now[0] = 100.0008
    sched.submit(Session(1, [6, 7], 4))
    assert due() == pytest.approx(100.0018)  # another: the quiet gap starts again
    for k in range(2, 8):  # a steady trickle ends the wait at GATHER_SPAN gaps after the first
        now[0] += 0.0008
        sched.submit(Session(k, [6, 7], 4))
    assert due() == pytest.approx(100.0 + GATHER_SPAN / 1e3)
    first = sched.plan()
    assert len(first.plan.chunks) == 8  # every one of them in the first tick
    ticks.send(first)
    assert due() == first.predicted_ms == 0.0  # in flight with no prediction yet: plan now
    sched.submit(Session(8, [6, 7], 4))  # one that comes while a tick runs waits for no gap
    assert due() == ticks.pipeline.plan_ahead_at() == 0.0
    sched.apply(ticks.pipeline.answer(first.t), engine.step(first.plan))
    second = sched.plan()
    ticks.send(second)
    assert second is not None and ticks.pipeline.answer(second.t) is second
    sched.submit(Session(9, [6, 7], 4))  # engine idle between ticks, sessions decoding: no gathering
    assert due() == 0.0
    _, idle = build(FakeEngine(n_seq_max=8), clock=lambda: now[0], gather_ms=0.0)
    idle.submit(Session(0, [3, 4, 5], 4))
    assert idle.gather_until() == 0.0  # gather_ms 0: off
