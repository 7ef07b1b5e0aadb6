"""Hypothesis drives submit / tick / cancel / engine failure against the invariants."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from helpers import Pipelined, run_to_completion, scheduler, step
from meshnode.core import reasons as R
from meshnode.core.session import Session
from meshnode.dev.fake import FakeEngine


class SchedulerMachine(RuleBasedStateMachine):
    depth = 1
    cache, pool_cells = "off", 0
    policy = "fcfs"

    def __init__(self):
        super().__init__()
        self.engine, self.sched = scheduler(FakeEngine(n_seq_max=4, n_ctx=512, n_ctx_seq=256),
                                            max_active=3, max_queue=3, max_batch_size=3,
                                            max_prefill_tokens_per_tick=7, kv_budget_bytes=1024 * 300,
                                            prefix_cache=self.cache, pool_cells=self.pool_cells, policy=self.policy)
        self.budget = self.sched.budget
        self.n = 0
        self.submitted = self.accepted = self.rejected = 0
        self.ends: dict = {}  # key -> number of done events
        self.finished: list[list[int]] = []  # every ended session's tokens, for follow-up turns

    def _record(self, events):
        for ev in events:
            if ev.kind == "done":
                s = ev.session
                self.ends[s.key] = self.ends.get(s.key, 0) + 1
                # whatever was reused, restarted or refused on the way, the tokens are a cold run's
                assert self.engine.expected(s.tokens, len(s.prompt)), f"session {s.key} got wrong tokens"
                self.finished.append(list(s.tokens))

    def _submit(self, prompt, max_tokens, stop=frozenset(), owner=0, priority=0):
        self.n += 1
        s = Session(self.n, prompt, max_tokens, stop_tokens=frozenset(stop), owner=owner,
                    priority=priority if self.policy == "priority" else 0)
        d = self.sched.submit(s)
        self.submitted += 1
        self._record(d.displaced)  # queued ones it took the place of (priority policy) end here
        if d.accepted:
            self.accepted += 1
            self.ends.setdefault(s.key, 0)
        else:
            self.rejected += 1
            assert d.reason in R.REJECTIONS

    @rule(n_prompt=st.integers(0, 120), max_tokens=st.integers(0, 60), stop=st.sets(st.integers(3, 511), max_size=3),
          topic=st.integers(0, 2), owner=st.integers(0, 1), priority=st.integers(-1, 2))
    def submit(self, n_prompt, max_tokens, stop, topic, owner, priority):
        """Prompts of one topic share their opening tokens: the prefix cache's food. (Priorities only
        under the priority policy: a better one preempts running sessions.)"""
        self._submit([3 + (topic * 7 + i) % 500 for i in range(n_prompt)], max_tokens, stop, owner, priority)

    @rule(pick=st.integers(0, 1000), extra=st.integers(0, 20), max_tokens=st.integers(1, 30), owner=st.integers(0, 1))
    def next_turn(self, pick, extra, max_tokens, owner):
        """A conversation goes on: an ended session's tokens plus a few new ones."""
        if self.finished:
            base = self.finished[pick % len(self.finished)]
            self._submit(base + [5 + i for i in range(extra)], max_tokens, owner=owner)

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
            self._record(self.sched.refused(tick, "ENGINE_ERROR"))

    @invariant()
    def bounds_hold(self):
        s, b = self.sched, self.budget
        assert len([w for w in s.waiting if not w.stale_before]) <= b.max_queue  # preempted ones come back
        assert all(w.n_planned == w.draws_in_flight == 0 and w.seq_id < 0 for w in s.waiting)
        assert len(s.running) <= b.effective_active_cap
        assert 0 <= s.admission.kv_reserved_bytes <= b.kv_budget_bytes
        assert 0 <= s.admission.scratch_reserved_bytes <= b.scratch_envelope_bytes
        assert self.accepted + self.rejected == self.submitted
        assert all(n <= 1 for n in self.ends.values())  # never two dones
        held = [x.seq_id for x in s.running] + list(s.seqs.cache.entries)
        assert len(held) == len(set(held)) and not set(held) & set(s.seqs.free)  # each id has one owner
        assert len(held) + len(s.seqs.free) == b.n_seq_max
        if s.pool_cells:
            reserved = s.admission.kv_reserved_bytes // b.kv_bytes_per_token
            assert reserved + s.seqs.cells <= s.pool_cells or not s.seqs.cache.entries

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
        self.driver = Pipelined(self.sched, self.engine, depth=self.depth)

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
        self.driver = Pipelined(self.sched, self.engine, depth=self.depth)

    @rule()
    def engine_refuses_plan(self):
        self._run_oldest(self.driver.refuse)

    @rule()
    def engine_has_no_kv_room(self):
        self._run_oldest(self.driver.miss)

    def finish(self):
        events = self.driver.run_to_completion(5000)
        cached = set(self.sched.seqs.cache.entries)
        assert all(p == 0 for i, p in enumerate(self.engine._next_pos) if i not in cached)
        return events


class CachedMachine(SchedulerMachine):
    """With the prefix cache on (any client's KV, one pool of cells as a unified KV has)."""

    cache, pool_cells = "node", 320


class PipelinedCachedMachine(PipelinedMachine):
    cache, pool_cells = "client", 0


class PipelinedPriorityMachine(PipelinedMachine):
    """Priorities, so running sessions are preempted mid-prompt and mid-generation with ticks in flight;
    the prefix cache takes a preempted session's KV."""

    cache, pool_cells, policy = "client", 0, "priority"


TestScheduler = SchedulerMachine.TestCase
TestPipelined = PipelinedMachine.TestCase
TestCached = CachedMachine.TestCase
TestPipelinedCached = PipelinedCachedMachine.TestCase
TestPipelinedPriority = PipelinedPriorityMachine.TestCase
for case in (TestScheduler, TestPipelined, TestCached, TestPipelinedCached, TestPipelinedPriority):
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
