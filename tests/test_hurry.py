"""A tick asked to hurry (a better request's first token waits): its chunks are left undone, whether their
llama_decode had begun or not (a multi-step tick: the step running, where it is one call, and the ones after
it), and planned again from
where they were; nothing else changes. Engine over the tiny model; the scheduler's side over the fake engine;
the front's ask (Ticks.hurry) over a stub link."""
import numpy as np
import pytest

from helpers import prompt, run_to_completion, scheduler, step
from ipc import link
from meshnode.core import reasons as R
from meshnode.core.pipeline import Tick
from meshnode.core.session import QUEUED, Session
from meshnode.core.types import GREEDY, InvalidPlan, Plan, SeqChunk, StepResult
from meshnode.dev.fake import FakeEngine
from meshnode.dev.nodeproc import NodeProcess
from meshnode.engine.followups import Followups
from meshnode.engine.llama import LlamaEngine
from meshnode.front.ticks import Ticks
from meshnode.ops.config import engine_config


def _chunks(low_prompt):
    """A decode row of sequence 0 (one token after a 4-token prompt) and a prompt chunk of sequence 1."""
    return [SeqChunk(0, 4, np.array([7], np.int32), draw=1, sampling=None),
            SeqChunk(1, 0, np.array(low_prompt, np.int32), draw=0, sampling=GREEDY)]


@pytest.mark.parametrize("asks", [0, 1])
def test_a_hurried_tick_leaves_its_calls_undone_and_the_kv_as_before_them(tiny_model, asks):
    """The hurry is seen at the `asks`-th question: 0, before any call (both skipped); 1, inside the first
    call (llama.cpp's abort callback stops it at its first graph node: its cells removed), then before the
    second. Each call is left undone, its sequences hold what they held before, and running the tick again
    gives the unhurried tick's tokens."""
    low = prompt(40, salt=3)
    cfg = engine_config(tiny_model, n_seq_max=4, ctx=1024, threads=1, kv_layout="streams",
                        scheduling_policy="priority")
    got = {}
    for hurry in (False, True):
        with LlamaEngine(cfg) as e:
            e.step(Plan([SeqChunk(0, 0, np.array(prompt(4), np.int32), draw=0, sampling=GREEDY)]))
            asked = []
            if hurry:
                e.hurry_when(lambda: asked.append(1) or len(asked) > asks)
            res = e.step(Plan(_chunks(low)))
            e.hurry_when(lambda: False)
            if hurry:
                assert sorted(res.deferred) == [0, 1] and res.tokens == {} and len(asked) == asks + 2
                assert e.seq_pos_max(0) == 3 and e.seq_pos_max(1) == -1
                again = e.step(Plan([c for c in _chunks(low) if c.seq_id in res.deferred]))
                res.tokens |= again.tokens
            else:
                assert res.deferred == []
            got[hurry] = dict(res.tokens)
    assert got[True] == got[False]


def test_a_hurry_inside_a_later_step_of_a_multi_step_tick_undoes_that_step_whole(tiny_model):
    """The hurry comes while the tick's second step is in its llama_decode (one call, no drafts): llama.cpp stops
    it, its cells removed, and the tick is its first step (StepResult.steps 1, no earlier samples), its rows'
    KV as after that step; the steps run again from there give the unhurried tokens."""
    cfg = engine_config(tiny_model, n_seq_max=4, ctx=1024, threads=1, kv_layout="streams", spec="off",
                        scheduling_policy="priority")
    def rows(steps, pos=4, toks=(7, 8), draw=1):
        return Plan([SeqChunk(s, pos, np.array([t], np.int32), draw=draw) for s, t in enumerate(toks)], steps=steps)

    got = {}
    for hurry in (False, True):
        with LlamaEngine(cfg) as e:
            e.step(Plan([SeqChunk(s, 0, np.array(prompt(4, salt=s), np.int32), draw=0, sampling=GREEDY)
                         for s in (0, 1)]))
            calls, inside, decode = [0], [False], e._b.decode

            def counted():
                calls[0] += 1
                inside[0] = hurry and calls[0] == 2  # the second step's llama_decode
                try:
                    return decode()
                finally:
                    inside[0] = False
            e._b.decode = counted
            e.hurry_when(lambda: inside[0])
            res = e.step(rows(4))
            e.hurry_when(lambda: False)
            samples = {s: [t for t, _ in res.samples(s)] for s in (0, 1)}
            if hurry:
                assert res.steps == 1 and res.earlier == {} and res.deferred == [] and calls[0] == 2
                assert e.seq_pos_max(0) == 4 and e.seq_pos_max(1) == 4
                more = e.step(rows(3, 5, (res.tokens[0], res.tokens[1]), 2))
                samples = {s: samples[s] + [t for t, _ in more.samples(s)] for s in (0, 1)}
            got[hurry] = samples
    assert got[True] == got[False] and len(got[False][0]) == 4


def test_an_engine_of_a_node_that_never_hurries_runs_every_call_with_no_abort_callback(tiny_model):
    """fcfs (the default): no tick is ever hurried, so no llama_decode pays llama.cpp's abort callback, and a
    `hurried` that says yes changes nothing."""
    with LlamaEngine(engine_config(tiny_model, n_seq_max=4, ctx=1024, threads=1, kv_layout="streams")) as e:
        e.step(Plan([SeqChunk(0, 0, np.array(prompt(4), np.int32), draw=0, sampling=GREEDY)]))
        asked = []
        e.hurry_when(lambda: asked.append(1) or True)
        res = e.step(Plan(_chunks(prompt(40, salt=3))))
    assert res.deferred == [] and set(res.tokens) == {0, 1} and asked == []


def _decoding_and_prompting(a_tokens: int):
    """(engine, scheduler, a, b) over the fake engine: `a` decoding, `b` just admitted, its 40-token prompt
    three ticks of 16."""
    engine, sched = scheduler(policy="priority", max_active=3, steps_ms=0.0, prefix_cache="off",
                              max_prefill_tokens_per_tick=16)
    a, b = Session("a", prompt(4), a_tokens, priority=2), Session("b", prompt(40, salt=1), 6, priority=2)
    sched.submit(a)
    step(sched, engine, sched.plan())
    sched.submit(b)
    return engine, sched, a, b


def test_a_deferred_prompt_chunk_is_planned_again_from_where_it_was():
    """The scheduler's side: a result that names a chunk deferred leaves its session where it was; it is cut
    again, finishes, and every session's tokens are a lone run's."""
    engine, sched, a, b = _decoding_and_prompting(6)
    tick = sched.plan()
    assert {c.seq_id for c in tick.plan.chunks} == {a.seq_id, b.seq_id}
    run = Plan([c for c in tick.plan.chunks if c.seq_id != b.seq_id])  # what the engine ran of it
    res = engine.step(run)
    res.deferred = [b.seq_id]
    sched.apply(tick, res)
    assert b.n_planned == 0 and a.n_generated == 2
    nxt = sched.plan()
    assert [c.pos for c in nxt.plan.chunks if c.seq_id == b.seq_id] == [0]
    sched.apply(nxt, engine.step(nxt.plan))
    run_to_completion(sched, engine)
    for s in (a, b):
        assert s.reason == R.LENGTH and engine.expected(s.tokens, len(s.prompt))


@pytest.mark.parametrize("policy,priority,hurry", [("priority", -1, True), ("priority", 2, False),
                                                   ("fcfs", 0, False)])
def test_a_better_request_asks_a_hurry_once_while_worse_sessions_prefill(policy, priority, hurry):
    engine, sched = scheduler(policy=policy, max_active=4, steps_ms=0.0, prefix_cache="off")
    a, b = Session("a", prompt(4), 20, priority=2 * (policy == "priority")), \
        Session("b", prompt(300, salt=1), 5, priority=2 * (policy == "priority"))
    sched.submit(a)
    step(sched, engine, sched.plan())
    sched.submit(b)
    assert not sched.take_hurry()
    sched.submit(Session("c", prompt(5, salt=2), 3, priority=priority))
    assert sched.take_hurry() == hurry
    assert not sched.take_hurry()  # once an arrival


class _Link:
    can_send = True

    def __init__(self):
        self.hurried = []

    def hurry(self, t):
        self.hurried.append(t)

    def send(self, tick, fresh=False):
        pass


def _tick(t, n):
    return Tick(t, Plan([SeqChunk(0, 0, np.arange(n, dtype=np.int32), draw=-1)]))


def test_every_tick_in_flight_is_hurried_once_and_nothing_is_planned_on_top_of_them():
    """The ticks in flight were planned before the better request came; each leaves undone what it can, and
    no tick goes in flight until they are answered (one behind them might hold the next chunk of a prompt
    they leave undone)."""
    ln = _Link()
    ticks = Ticks(ln, depth=2, telemetry=None)
    ticks.hurry()
    assert ln.hurried == [] and ticks.room  # nothing in flight: nothing to ask
    ticks.send(_tick(1, 1))
    ticks.send(_tick(2, 8))
    ticks.hurry()
    assert ln.hurried == [2] and not ticks.room
    ticks.hurry()
    assert ln.hurried == [2]  # once
    ticks.pipeline.answer(1)
    assert not ticks.room
    ticks.pipeline.answer(2)
    assert ticks.room
    ticks.send(_tick(3, 1))
    ticks.hurry()
    assert ln.hurried == [2, 3]


def test_a_tick_hurried_before_it_began_runs_its_kv_operations_only():
    """In the engine process (engine/followups.py): its chunks come back deferred, its releases run."""
    engine = FakeEngine(n_seq_max=4, n_ctx=512)
    f = Followups()
    f.run(engine, Plan([SeqChunk(0, 0, np.array(prompt(4), np.int32), draw=0),
                        SeqChunk(1, 0, np.array(prompt(4, salt=1), np.int32), draw=0)]))
    res = f.run(engine, Plan([SeqChunk(0, 4, np.array([5], np.int32), draw=1, follow=True)], release=[1]),
                hurried=True)
    ran = engine.plans[-1]
    assert res.deferred == [0] and res.tokens == {} and ran.chunks == [] and ran.release == [1]
    res = f.run(engine, Plan([SeqChunk(0, 4, np.array([5], np.int32), draw=1)]))
    assert res.deferred == [] and 0 in res.tokens


def test_a_whole_deferred_tick_plans_its_decode_rows_and_prompts_again():
    """A tick queued at the engine when the hurry came runs nothing: its decode rows (follows of the tick
    before) and prompt chunk are planned again from where they were, every token still a lone run's."""
    engine, sched, a, b = _decoding_and_prompting(8)
    first = sched.plan()
    second = sched.plan()  # planned ahead: a's row follows first's sample, b's next prompt chunk
    events = sched.apply(first, engine.step(first.plan))
    engine.step(Plan([], second.plan.release, second.plan.kv))
    events += sched.apply(second, StepResult(deferred=[c.seq_id for c in second.plan.chunks]))
    assert b.n_planned == 16 and a.n_planned == 5 and a.draws_in_flight == 0  # as after `first`
    events += run_to_completion(sched, engine)
    for s in (a, b):
        assert s.reason == R.LENGTH and engine.expected(s.tokens, len(s.prompt))


def test_the_link_carries_the_hurry_and_the_deferred_chunks():
    assert link.decode(link.encode(link.Hurry(7))) == link.Hurry(7)
    done = link.decode(link.encode(link.TickDone(3, StepResult({0: 5}, deferred=[1, 2]))))
    assert done.result.deferred == [1, 2] and done.result.tokens == {0: 5}


@pytest.mark.parametrize("steps_ms", ["0", "50"])
def test_through_the_node_a_better_request_hurries_the_worse_class_and_nobody_loses_a_token(tiny_model, steps_ms):
    """A node under the priority policy, two low sessions decoding (a tick takes 30 ms, two in flight): a
    high request's arrival leaves the ticks in flight undone (deferred_chunks_total counts them; with
    multi-step ticks, "50", the running one stops between steps), it is served, and in deterministic mode every
    session's tokens are bitwise those of a node that never hurried."""
    args = ("--deterministic", "--decode-steps-ms", steps_ms, "--threads", "1", "--scheduling-policy", "priority")
    asks = {"lo1": dict(tokens=prompt(30, salt=1), max_tokens=60, ignore_eos=True, priority=3),
            "lo2": dict(tokens=prompt(20, salt=2), max_tokens=60, ignore_eos=True, priority=3),
            "hi": dict(tokens=prompt(12, salt=3), max_tokens=4, ignore_eos=True, priority=-1)}
    with NodeProcess(tiny_model, *args) as ref, ref.client() as c:
        want = {sid: c.generate(f"ref-{sid}", **ask).tokens for sid, ask in asks.items()}
    with NodeProcess(tiny_model, *args, internal={"faults": [{"step_sleep_s": 0.03}]}) as node, node.client() as c:
        for sid in ("lo1", "lo2"):
            c.submit(sid, **asks[sid])
        for sid in ("lo1", "lo2"):
            c.wait_for(lambda e: e["event"] == "tokens" and e["id"] == sid, keep=True)
        c.submit("hi", **asks["hi"])
        got = c.collect(list(asks))
        deferred = c.status()["telemetry"]["engine"]["deferred_chunks_total"]
    assert deferred > 0 or steps_ms != "0"
    for sid, r in got.items():
        assert r.done["reason"] == R.LENGTH and r.tokens == want[sid], sid


def test_a_hurried_multi_step_tick_stops_between_steps_and_the_rest_are_planned_again():
    """A hurry ends a tick of several decode steps after the step that is running (StepResult.steps; the fake
    engine does not stop a step inside), and the scheduler plans the steps it did not run again: every token
    once, each a lone run's."""
    engine, sched = scheduler(policy="priority", max_active=2, steps_ms=1000.0, prefix_cache="off")
    a = Session("a", prompt(4), 30, priority=2)
    sched.submit(a)
    step(sched, engine, sched.plan())
    step(sched, engine, sched.plan())  # the cost model has seen a decode tick: the next ones run several steps
    tick = sched.plan()
    assert tick.plan.steps > 3
    engine.hurry_when(lambda: len(engine.plans) >= 2 + 2)  # after the tick's second step
    res = engine.step(tick.plan)
    engine.hurry_when(lambda: False)
    assert res.steps == 2 and len(res.earlier[a.seq_id]) == 1
    events = sched.apply(tick, res)
    assert a.n_generated == 4 and a.pending == 1 and a.draws_in_flight == 0  # its next token is the last drawn
    events += run_to_completion(sched, engine)
    assert a.reason == R.LENGTH and engine.expected(a.tokens, len(a.prompt))
    assert [t for e in events if e.kind == "tokens" for t in e.tokens] == a.generated[2:]


def test_a_multi_step_tick_stopped_early_and_the_one_planned_on_it_deferred_leave_each_session_where_it_is():
    """The two ticks in flight when the hurry came: the running one (16 steps planned) stops after its first,
    the one planned on top of it (its rows at the positions the first would have reached) runs nothing. Each
    one's planning is undone exactly, so every session decodes on from its last sample, each token once."""
    engine, sched = scheduler(policy="priority", max_active=2, steps_ms=1000.0, prefix_cache="off")
    a, b = Session("a", prompt(4), 60, priority=2), Session("b", prompt(5, salt=1), 60, priority=2)
    for s in (a, b):
        sched.submit(s)
    events = []
    for _ in range(2):
        events += step(sched, engine, sched.plan())
    running, behind = sched.plan(), sched.plan()  # planned ahead: behind's rows follow running's last steps
    assert running.plan.steps > 2 and all(c.follow for c in behind.plan.chunks)
    engine.hurry_when(lambda: True)
    res = engine.step(running.plan)
    engine.hurry_when(lambda: False)
    assert res.steps == 1
    events += sched.apply(running, res)
    events += sched.apply(behind, StepResult(deferred=[c.seq_id for c in behind.plan.chunks]))
    assert all(s.pending == 1 and s.draws_in_flight == 0 for s in (a, b))
    events += run_to_completion(sched, engine)
    for s in (a, b):
        assert s.reason == R.LENGTH and engine.expected(s.tokens, len(s.prompt))
        assert [t for e in events if e.kind == "tokens" and e.session is s for t in e.tokens] == s.generated


@pytest.mark.parametrize("ends", ["cancel", "preempt"])
def test_a_session_that_ends_while_its_chunk_is_hurried_leaves_the_cache_only_what_was_computed(ends):
    """A session cancelled (or preempted) while a hurried tick holds its prompt chunk: the chunk comes back
    deferred, so its sequence holds nothing of it; a later prompt that opens the same way must not be told
    to keep KV that was never computed (the engine refused such a plan: "keep of 3 positions of sequence 0,
    which holds 0")."""
    engine, sched = scheduler(policy="priority", max_active=1, max_queue=2, steps_ms=0.0, prefix_cache="node")
    run = Session("run", prompt(24), 50, priority=2)
    sched.submit(run)
    tick = sched.plan()
    assert [c.seq_id for c in tick.plan.chunks] == [run.seq_id]  # in flight: the hurry comes before it runs
    ticks = [tick]
    if ends == "cancel":
        sched.cancel("run")
    else:  # a better request preempts it in a tick planned on top; a hurry then catches both in flight
        sched.submit(Session("better", prompt(5, salt=9), 2, priority=-1))
        ticks.append(sched.plan())
        assert run.state == QUEUED
    for tk in ticks:
        engine.step(Plan([], tk.plan.release, tk.plan.kv))
        sched.apply(tk, StepResult(deferred=[c.seq_id for c in tk.plan.chunks]))
    later = Session("later", prompt(24) + prompt(3, salt=1), 2, priority=-2)
    sched.submit(later)
    events = run_to_completion(sched, engine)  # the fake engine refuses a keep or share beyond what a sequence holds
    assert later.reason == R.LENGTH and engine.expected(later.tokens, len(later.prompt))
    assert later.n_reused == 0
    if ends == "preempt":
        assert run.reason == R.LENGTH and engine.expected(run.tokens, len(run.prompt))
    assert all(ev.reason != R.ENGINE_ERROR for ev in events)



def test_no_hurry_while_a_tick_behind_the_first_copies_kv_the_ones_before_it_compute():
    """Two sessions open with the same 40 tokens: the second waits for the first's prompt and copies it in
    the tick planned on top of the one computing its last chunk. A hurry would leave that chunk undone and
    the copy (a KV operation, which a hurried tick still runs) would read positions never computed: the
    engine refuses such a plan, ending both sessions. So the ticks are not hurried; the better request
    waits for them."""
    engine, sched = scheduler(policy="priority", max_active=4, steps_ms=0.0, prefix_cache="node",
                              max_prefill_tokens_per_tick=16)
    shared = prompt(40)
    a, b = Session("a", shared + [1], 3, priority=2), Session("b", shared + [2, 3], 3, priority=2)
    sched.submit(a)
    step(sched, engine, sched.plan())
    sched.submit(b)  # b's leader is a, still prefilling
    step(sched, engine, sched.plan())
    ln = _Link()
    ticks = Ticks(ln, depth=2, telemetry=None)
    first, behind = sched.plan(), sched.plan()
    assert any(len(c.tokens) > 1 and c.seq_id == a.seq_id for c in first.plan.chunks)  # a's last prompt chunk
    assert behind.plan.reads_kv and not first.plan.reads_kv  # b copies what `first` computes
    ticks.send(first)
    ticks.send(behind)
    ticks.hurry()
    assert ln.hurried == [] and not any(tk.hurried for tk in ticks.pipeline.ticks)
    engine.step(Plan([], first.plan.release, first.plan.kv))  # what a hurry would have done: refused
    with pytest.raises(InvalidPlan, match="share of"):
        engine.step(Plan([], behind.plan.release, behind.plan.kv))
