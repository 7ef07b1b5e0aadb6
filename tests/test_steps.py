"""Multi-step ticks (core/steps.py, Plan.steps): where every session decodes and none waits, one tick runs the
decode rows several times. The promise: the same tokens, events and ends as one step a tick, fewer ticks.
The fake engine's next token depends only on a sequence's own contents, so a token fed at a wrong position
or to a wrong sequence shows up as another output."""
import numpy as np
import pytest

from helpers import Pipelined, run_to_completion
from helpers import scheduler as build
from ipc import link
from ipc.shm import TokenArena
from meshnode.core import reasons as R
from meshnode.core.session import Session
from meshnode.core.steps import MAX_STEPS, decode_steps
from meshnode.core.types import InvalidPlan, Logprob, Plan, Sampling, SeqChunk, StepResult
from meshnode.dev.fake import FakeEngine
from meshnode.engine.followups import Followups


def test_steps_fit_the_budget_by_the_rows_measured_time_and_never_pass_a_sessions_last_token():
    assert decode_steps(None, 100, 50.0) == 1  # nothing measured yet
    assert decode_steps(6.0, 100, 50.0) == 9 and decode_steps(6.0, 3, 50.0) == 3  # 54 ms: within a tenth over
    assert decode_steps(60.0, 100, 50.0) == 1 and decode_steps(6.0, 100, 0.0) == 1
    assert decode_steps(0.1, 1000, 50.0) == MAX_STEPS


def test_a_step_count_that_misses_the_budget_by_less_than_a_tenth_still_runs():
    """8 rows of SmolLM2 q8_0 on 2 cores take 23-27 ms a step: a node whose own timing put them just over 25 ms
    ran one step a tick where the engine in process ran two, and its extra ticks slowed its steps further."""
    assert decode_steps(25.5, 100, 50.0) == decode_steps(24.5, 100, 50.0) == 2
    assert decode_steps(27.4, 100, 50.0) == 2 and decode_steps(27.6, 100, 50.0) == 1


def sessions(stops=None):
    """Prompts of 1 to 46 tokens, some seeded, some with stop tokens that end them early."""
    out = []
    for i in range(10):
        sampling = Sampling(0.8, 40, 0.95, seed=i) if i % 3 == 0 else Sampling()
        out.append(Session(i, [3 + (i * 31 + k * 7) % 500 for k in range(1 + 5 * i)], 20 + 9 * (i % 4), sampling,
                           stop_tokens=frozenset((stops or {}).get(i, ()))))
    return out


def run(steps_ms, make=sessions, pipelined=False, pipe=None):
    e = FakeEngine(cost_ms=lambda plan: 2.0 * len(plan.chunks))  # each step's time, as the engine reports it
    _, s = build(e, max_active=4, max_queue=20, steps_ms=steps_ms, prefix_cache="off")  # every finish releases
    for x in make():
        s.submit(x)
    events = Pipelined(s, e, **(pipe or {})).run_to_completion() if pipelined else run_to_completion(s, e)
    done = {ev.session.key: (ev.reason, ev.tokens) for ev in events if ev.kind == "done"}
    streamed = {}
    for ev in events:
        if ev.kind == "tokens":
            streamed.setdefault(ev.session.key, []).extend(ev.tokens)
    return done, streamed, e, s


@pytest.mark.parametrize("pipelined", [False, True])
def test_several_steps_a_tick_give_the_one_step_tokens_events_and_ends(pipelined):
    one, _, e1, _ = run(0.0)
    first = {k: toks for k, (_, toks) in one.items()}
    stops = {i: {toks[len(toks) // 2]} for i, toks in first.items() if i % 2}  # ends no step foresees
    one, one_streamed, _, s1 = run(0.0, lambda: sessions(stops))
    many, streamed, e, s = run(30.0, lambda: sessions(stops), pipelined)
    assert many == one and streamed == one_streamed == {k: toks for k, (_, toks) in one.items()}
    assert {r for r, _ in many.values()} == {R.STOP, R.LENGTH}
    assert max(p.steps for p in e.plans) > 1 and s.counters.ticks < s1.counters.ticks  # fewer ticks, same tokens
    assert not s.live and s.admission.kv_reserved_bytes == 0 and e._next_pos == [0] * e.n_seq_max


def test_no_tick_runs_several_steps_while_a_prompt_is_prefilled_or_a_stop_string_is_watched():
    e = FakeEngine(cost_ms=lambda plan: 2.0)
    _, s = build(e, max_active=2, max_queue=8, steps_ms=50.0, prefix_cache="off", max_prefill_tokens_per_tick=16)
    s.submit(Session(0, [3, 4, 5], 40))
    for _ in range(6):
        tick = s.plan()
        s.apply(tick, e.step(tick.plan))
    s.submit(Session(1, [3 + k % 50 for k in range(300)], 40))  # a long prompt, prefilled beside the decode row
    for _ in range(6):
        tick = s.plan()
        assert tick.plan.steps == 1 and any(len(c.tokens) > 1 for c in tick.plan.chunks)
        s.apply(tick, e.step(tick.plan))
    e = FakeEngine(cost_ms=lambda plan: 2.0)
    _, s = build(e, max_active=2, steps_ms=50.0)
    s.submit(Session("watched", [3, 4, 5], 40, stop_text=True))
    for _ in range(6):
        tick = s.plan()
        assert tick.plan.steps == 1
        s.apply(tick, e.step(tick.plan))


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_queue_that_waits_for_a_slot_does_not_stop_several_steps(pipelined):
    """Nobody queued can start before a running session ends, so the decode rows run several steps a tick
    (a session's last token by length ends its tick), with one step a tick's tokens, in fewer ticks."""
    def make():
        return [Session(i, [3 + i, 40 + i], 12 + 10 * i, ignore_eos=True) for i in range(5)]

    want, _, _, one = run(0.0, make)
    e = FakeEngine(cost_ms=lambda plan: 1.0)
    _, s = build(e, max_active=2, max_queue=8, steps_ms=30.0, prefix_cache="off")
    for x in make():
        s.submit(x)
    seen = []  # (a session waited in the queue when planned, the steps planned)
    driver = Pipelined(s, e) if pipelined else None
    plan = s.plan
    s.plan = lambda: (lambda t: (seen.append((bool(s.waiting), t.plan.steps)) if t else None, t)[1])(plan())
    events = driver.run_to_completion() if pipelined else run_to_completion(s, e)
    got = {ev.session.key: (ev.reason, ev.tokens) for ev in events if ev.kind == "done"}
    assert got == want
    assert any(waited and steps > 1 for waited, steps in seen) and s.counters.ticks < one.counters.ticks
    assert not s.live and not s.waiting


def test_a_multi_step_tick_stops_at_the_nearest_last_token_and_the_pending_sample_is_never_fed():
    e = FakeEngine(cost_ms=lambda plan: 1.0)
    _, s = build(e, max_active=2, steps_ms=1000.0)
    s.submit(Session("short", [3, 4], 5))
    s.submit(Session("long", [5, 6], 200))
    done = {ev.session.key: ev.session for ev in run_to_completion(s, e) if ev.kind == "done"}
    assert done["short"].n_generated == 5 and done["long"].n_generated == 200
    assert all(p.steps <= 4 for p in e.plans if any(c.seq_id == done["short"].seq_id for c in p.chunks))


@pytest.mark.parametrize("pipe", [{"miss": (6,)}, {"refuse": (6,)}, {"miss": (4, 9), "refuse": (12,)}])
def test_a_lost_or_refused_multi_step_tick_ends_its_sessions_once_and_the_rest_go_on(pipe):
    """What one step a tick does on a cache miss or a refused plan, a multi-step tick does too: its sessions
    end once (CACHE_MISS, ENGINE_ERROR); the others keep the tokens one step a tick gives."""
    want, _, _, _ = run(0.0)
    got, streamed, e, s = run(30.0, pipelined=True, pipe=pipe)
    assert set(got) == set(want)
    for k, (reason, toks) in got.items():
        if reason in (R.CACHE_MISS, R.ENGINE_ERROR):
            assert toks == want[k][1][:len(toks)]
        else:
            assert (reason, toks) == want[k] and streamed[k] == toks
    assert {r for r, _ in got.values()} & {R.CACHE_MISS, R.ENGINE_ERROR}
    assert not s.live and e._next_pos == [0] * e.n_seq_max


class Fed(FakeEngine):
    """Records the last position each llama_decode-like step fed for each sequence."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.fed: dict[int, int] = {}

    def step_once(self, plan):
        res = super().step_once(plan)
        for c in plan.chunks:
            self.fed[c.seq_id] = max(self.fed.get(c.seq_id, -1), c.pos + len(c.tokens) - 1)
        return res


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_row_stops_on_the_token_that_ends_its_session_and_the_steps_after_it_never_run(pipelined):
    """Sessions end on the model's end token or a stop token in the middle of long multi-step ticks: each one's
    row stops there (its end token never fed, not even by a tick planned on top before its end was seen), their tokens
    are one step a tick's, and the others run on."""
    def make(ends):
        return [Session(i, [3 + i, 40 + i], 60, stop_tokens=frozenset(ends.get(i, ())), ignore_eos=i == 3)
                for i in range(4)]

    one, _, _, _ = run(0.0, lambda: make({}))
    ends = {i: {one[i][1][10 + 7 * i]} for i in range(3)}  # each ends on its 11th, 18th, 25th token
    want, _, _, _ = run(0.0, lambda: make(ends))
    e = Fed(cost_ms=lambda plan: 1.0)
    _, s = build(e, max_active=4, steps_ms=15.0, prefix_cache="off")
    sessions_ = make(ends)
    for x in sessions_:
        s.submit(x)
    events = Pipelined(s, e).run_to_completion() if pipelined else run_to_completion(s, e)
    got = {ev.session.key: (ev.reason, ev.tokens) for ev in events if ev.kind == "done"}
    assert got == want and [got[i][0] for i in range(4)] == [R.STOP, R.STOP, R.STOP, R.LENGTH]
    assert max(p.steps for p in e.plans) == decode_steps(1.0, 100, 15.0) > 1 and any(p.ends for p in e.plans)
    for x in sessions_[:3]:
        assert e.fed[x.seq_id] <= len(x.prompt) + x.n_generated - 2, x.key
    assert e.fed[sessions_[3].seq_id] >= len(sessions_[3].prompt) + 60 - 2
    assert not s.live and e._next_pos == [0] * e.n_seq_max


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_conversation_that_ended_inside_a_multi_step_tick_is_reused_only_as_far_as_its_kv_goes(pipelined):
    """The prefix cache keeps what the engine computed for a session whose row stopped on its end: the next
    turn reuses it, and gets what a cold run gives (the fake's tokens are a hash of the sequence's contents)."""
    e = FakeEngine(cost_ms=lambda plan: 1.0)
    _, s = build(e, max_active=2, steps_ms=15.0)
    ref = Session("ref", [5, 6, 7], 40)
    s.submit(ref)
    run_to_completion(s, e)
    a = Session("a", [5, 6, 7], 40, stop_tokens=frozenset({ref.tokens[12]}))
    s.submit(a)
    Pipelined(s, e).run_to_completion() if pipelined else run_to_completion(s, e)
    assert a.reason == R.STOP and a.tokens == ref.tokens[:ref.tokens.index(ref.tokens[12]) + 1]
    assert any(p.steps > 1 and p.ends for p in e.plans)
    b = Session("b", a.tokens + [9, 10], 30)  # its tokens: the prompt, then what it generated
    s.submit(b)
    Pipelined(s, e).run_to_completion() if pipelined else run_to_completion(s, e)
    assert 3 <= b.n_reused <= len(a.tokens) - 1  # its end token was never fed
    assert e.expected(b.tokens, len(b.prompt))


def test_the_engine_stops_a_row_on_an_end_token_and_the_tick_on_top_drops_its_follow_row_unreported():
    prompts = Plan([SeqChunk(0, 0, np.array([3, 4, 5], np.int32), draw=-1), SeqChunk(1, 0, np.array([6, 7], np.int32),
                                                                                      draw=-1)])
    def rows(steps, ends=None):
        return Plan([SeqChunk(0, 3, np.array([9], np.int32), draw=1, sampling=Sampling()),
                     SeqChunk(1, 2, np.array([8], np.int32), draw=1, sampling=Sampling())], steps=steps, ends=ends or {})

    free = FakeEngine()
    free.step(prompts)
    want = free.step(rows(5))
    end = [t for t, _ in want.samples(0)][1]  # sequence 0's second sample ends it
    e, fu = FakeEngine(), Followups()
    fu.run(e, prompts)
    res = fu.run(e, rows(5, {0: frozenset({end}), 1: frozenset({1})}))
    assert [t for t, _ in res.samples(0)] == [t for t, _ in want.samples(0)][:2] and res.steps == 5
    assert [t for t, _ in res.samples(1)] == [t for t, _ in want.samples(1)]
    assert e._next_pos[:2] == [5, 7]  # sequence 0 fed its first sample only
    link.check_earlier(res.earlier, rows(5, {0: frozenset({end})}), res.tokens, e.n_vocab, 5)
    with pytest.raises(ValueError):  # stopping early is for a row's end only
        link.check_earlier(res.earlier, rows(5), res.tokens, e.n_vocab, 5)
    on_top = Plan([SeqChunk(0, 8, np.array([-1], np.int32), draw=6, follow=True),
                   SeqChunk(1, 7, np.array([-1], np.int32), draw=6, follow=True)])
    nxt = fu.run(e, on_top)
    assert set(nxt.tokens) == {1} and nxt.ended == [0] and nxt.cache_miss == [] and e._next_pos[:2] == [5, 8]
    back = link.decode(link.encode(link.TickDone(7, nxt))).result
    assert back.ended == [0]
    link.check_samples(back.tokens, on_top, e.n_vocab, {*back.ended})


class Failing(FakeEngine):
    """Sequence `seq` fails at its `at`-th sample (a response_format the library gives up on)."""

    def __init__(self, seq, at):
        super().__init__()
        self.seq, self.at, self.n = seq, at, 0

    def _run(self, plan):
        res = super()._run(plan)
        if self.seq in res.tokens:
            self.n += 1
            if self.n == self.at:
                res.failed[self.seq] = "no token may come next"
                del res.tokens[self.seq]
        return res


def test_a_row_that_fails_mid_tick_drops_out_of_the_next_pipelined_multi_step_tick_and_nobody_else_does():
    """The next tick was planned with the failed session's follow row in it: the engine drops that row and still
    runs the tick's steps for the rest (a rebuilt plan that lost its steps would put them at wrong positions)."""
    def make():
        return [Session(i, [3 + i, 40 + i], 60, ignore_eos=True) for i in range(3)]

    want, _, _, _ = run(0.0, make)
    e = Failing(1, 7)
    e.cost_ms = lambda plan: 2.0
    _, s = build(e, max_active=4, steps_ms=30.0)
    for x in make():
        s.submit(x)
    events = Pipelined(s, e).run_to_completion()
    got = {ev.session.key: (ev.reason, ev.tokens) for ev in events if ev.kind == "done"}
    assert got[1][0] == R.BAD_REQUEST and got[1][1] == want[1][1][:len(got[1][1])]
    assert got[0] == want[0] and got[2] == want[2]
    assert any(p.steps > 1 and len(p.chunks) == 2 for p in e.plans)  # the two went on, several steps a tick


def test_the_engine_runs_a_plans_steps_as_single_steps_and_a_failed_row_drops_out():
    plan = lambda steps: Plan([SeqChunk(0, 3, np.array([9], np.int32), draw=1, sampling=Sampling()),  # noqa: E731
                               SeqChunk(1, 2, np.array([8], np.int32), draw=1, sampling=Sampling(logprobs=1))],
                              steps=steps)
    prompts = Plan([SeqChunk(0, 0, np.array([3, 4, 5], np.int32), draw=-1),
                    SeqChunk(1, 0, np.array([6, 7], np.int32), draw=-1)])
    one = FakeEngine()
    one.step(prompts)
    samples = {0: [], 1: []}
    p = plan(1)
    for _ in range(5):
        res = one.step(p)
        for c in p.chunks:
            samples[c.seq_id].append(res.tokens[c.seq_id])
        p = Plan([SeqChunk(c.seq_id, c.pos + 1, np.array([res.tokens[c.seq_id]], np.int32), draw=c.draw + 1)
                  for c in p.chunks])
    many = FakeEngine()
    many.step(prompts)
    res = many.step(plan(5))
    assert {s: [t for t, _ in res.samples(s)] for s in (0, 1)} == samples
    assert many._next_pos[:2] == one._next_pos[:2] == [8, 7]
    failing = Failing(1, 3)
    failing.step(prompts)
    res = failing.step(plan(5))
    assert [t for t, _ in res.samples(1)] == samples[1][:2] and res.failed == {1: "no token may come next"}
    assert [t for t, _ in res.samples(0)] == samples[0]
    with pytest.raises(InvalidPlan, match="one-token rows"):
        FakeEngine().step(Plan(prompts.chunks, steps=2))


def test_a_multi_step_tick_crosses_the_link_and_a_reply_that_breaks_it_is_refused():
    arena = TokenArena.create(link.arena_tokens(64))
    try:
        plan = Plan([SeqChunk(0, 5, np.array([7], np.int32), draw=2)], steps=3, ends={0: frozenset({2, 5})})
        got = link.decode(link.encode(link.TickRequest(4, plan), arena), arena)
        assert got.plan.steps == 3 and got.plan.chunks[0].pos == 5 and got.plan.ends == {0: {2, 5}}
        lp = Logprob(-0.5, ((7, -0.5), (9, -1.5)))
        res = StepResult({0: 11}, earlier={0: [(9, lp), (10, None)]})
        back = link.decode(link.encode(link.TickDone(4, res)), arena).result
        assert back.earlier == {0: [(9, lp), (10, None)]}
        link.check_earlier(back.earlier, plan, {0: 11}, 100, 3)
        link.check_earlier({0: [(9, None)]}, plan, {0: 11}, 100, 2)  # a hurry stopped it after its second step
        hurried = link.decode(link.encode(link.TickDone(4, StepResult({0: 11}, earlier={0: [(9, None)]}, steps=2))))
        assert hurried.result.steps == 2
        for steps in (0, 4):
            with pytest.raises(ValueError):
                link.check_earlier({}, plan, {0: 11}, 100, steps)
        for earlier, last in (({0: [(9, None)]}, {0: 11}), ({0: [(9, None), (10, None), (11, None)]}, {}),
                              ({1: [(9, None)]}, {}), ({0: [(900, None), (1, None)]}, {0: 11})):
            with pytest.raises(ValueError):
                link.check_earlier(earlier, plan, last, 100, 3)
        link.check_earlier({0: [(9, None)]}, plan, {}, 100, 3)  # dropped out after a step: fewer, and no last
    finally:
        arena.close()
