"""Hypothesis drives submit / tick / cancel / engine failure against the invariants."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from helpers import Pipelined, run_to_completion, scheduler, step
from meshnode.core import reasons as R
from meshnode.core.session import Session
from meshnode.engine.fake import FakeEngine


class SchedulerMachine(RuleBasedStateMachine):
    depth = 1

    def __init__(self):
        super().__init__()
        self.engine, self.sched = scheduler(FakeEngine(n_seq_max=4, n_ctx=512, n_ctx_seq=256), depth=self.depth,
                                            max_active=3, max_queue=3, max_batch_size=3,
                                            max_prefill_tokens_per_tick=7, kv_budget_bytes=1024 * 300)
        self.budget = self.sched.budget
        self.n = 0
        self.submitted = self.accepted = self.rejected = 0
        self.ends: dict = {}  # key -> number of done events

    def _record(self, events):
        for ev in events:
            if ev.kind == "done":
                self.ends[ev.session.key] = self.ends.get(ev.session.key, 0) + 1

    @rule(n_prompt=st.integers(0, 120), max_tokens=st.integers(0, 60), stop=st.sets(st.integers(3, 511), max_size=3))
    def submit(self, n_prompt, max_tokens, stop):
        self.n += 1
        s = Session(self.n, [3 + (self.n * 7 + i) % 500 for i in range(n_prompt)], max_tokens,
                    stop_tokens=frozenset(stop))
        d = self.sched.submit(s)
        self.submitted += 1
        if d.accepted:
            self.accepted += 1
            self.ends.setdefault(s.key, 0)
        else:
            self.rejected += 1
            assert d.reason in R.REJECTIONS

    @rule()
    def tick(self):
        before = self.sched.counters.prefill_tokens
        tick = self.sched.plan()
        if tick is None:
            return
        assert len(tick.plan.chunks) <= self.budget.max_batch_size
        assert self.sched.counters.prefill_tokens - before <= self.budget.max_prefill_tokens_per_tick
        self._record(step(self.sched, self.engine, tick))

    @rule(k=st.integers(1, 40))
    def cancel(self, k):
        ev = self.sched.cancel(k)
        if ev is not None:
            self._record([ev])

    @rule()
    def engine_fails(self):
        """A tick goes out and the engine dies with it: a fresh engine, every session re-prefilled."""
        self.sched.plan()
        self.engine = FakeEngine(n_seq_max=4, n_ctx=512, n_ctx_seq=256)
        self.sched.engine_restarted()

    @rule()
    def engine_refuses_plan(self):
        """The engine refuses a plan (InvalidPlan): its sessions end, the rest go on."""
        tick = self.sched.plan()
        if tick is not None:
            self._record(self.sched.refused(self.sched.pipeline.answer(tick.t), "ENGINE_ERROR"))

    @invariant()
    def bounds_hold(self):
        s, b = self.sched, self.budget
        assert len(s.waiting) <= b.max_queue
        assert len(s.running) <= b.effective_active_cap
        assert 0 <= s.admission.kv_reserved_bytes <= b.kv_budget_bytes
        assert 0 <= s.admission.scratch_reserved_bytes <= b.scratch_envelope_bytes
        assert self.accepted + self.rejected == self.submitted
        assert all(n <= 1 for n in self.ends.values())  # never two dones

    def finish(self):
        return run_to_completion(self.sched, self.engine, 5000)

    def teardown(self):
        self._record(self.finish())
        assert all(n == 1 for n in self.ends.values()), "a session ended without exactly one done"
        assert len(self.ends) == self.accepted
        assert self.sched.admission.kv_reserved_bytes == 0 and not self.sched.live


class PipelinedMachine(SchedulerMachine):
    """The same rules and invariants with ticks planned ahead of the engine, as the node runs them."""

    depth = 2

    def __init__(self):
        super().__init__()
        self.driver = Pipelined(self.sched, self.engine)

    def _run_oldest(self, fault: set | None = None):
        """Plan ahead, then the engine runs the oldest queued tick, into `fault` if given."""
        self.driver.fill()
        if self.driver.sent:
            if fault is not None:
                fault.add(self.driver.sent[0].t)
            self._record(self.driver.run_one())

    @rule()
    def tick(self):
        self._run_oldest()

    @rule()
    def engine_fails(self):
        """The engine dies with every queued tick: a fresh engine, every session re-prefilled."""
        self.driver.fill()
        self.engine = FakeEngine(n_seq_max=4, n_ctx=512, n_ctx_seq=256)
        self.sched.engine_restarted()
        self.driver = Pipelined(self.sched, self.engine)

    @rule()
    def engine_refuses_plan(self):
        self._run_oldest(self.driver.refuse)

    @rule()
    def engine_has_no_kv_room(self):
        self._run_oldest(self.driver.miss)

    def finish(self):
        events = self.driver.run_to_completion(5000)
        assert self.engine._next_pos == [0] * self.engine.n_seq_max
        return events


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPipelined = PipelinedMachine.TestCase
TestPipelined.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
