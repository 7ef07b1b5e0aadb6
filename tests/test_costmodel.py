"""The tick cost model, the tick-time target and the capacity estimate, against a fake engine whose
step time is a known function of the plan (the clock moves by exactly that time)."""
import numpy as np

from helpers import Clock, scheduler
from meshnode.core.capacity import capacity
from meshnode.core.costmodel import TickCost, attention
from meshnode.core.session import Session
from meshnode.engine.fake import FakeEngine

BASE, PER_ROW, PER_CELL = 30.0, 2.0, 0.002  # ms; a unified KV: every row attends to every cell in use


def true_ms(plan, cells):
    rows = plan.n_tokens
    return BASE + PER_ROW * rows + PER_CELL * rows * cells


class Node:
    """A scheduler and a fake engine in lockstep on a clock that only the engine's steps move."""

    def __init__(self, target=200.0, top=512, slow_every=0):
        self.clock = Clock(0.0)
        self.n = 0

        def cost(plan):
            self.n += 1
            ms = true_ms(plan, sum(self.engine._next_pos))
            return ms * 6 if slow_every and self.n % slow_every == 0 else ms  # a stall now and then

        self.engine, self.sched = scheduler(FakeEngine(n_seq_max=8, n_ctx=16384, n_batch=1024, cost_ms=cost),
                                            clock=self.clock, max_prefill_tokens_per_tick=top)
        self.sched.tick_target_ms, self.sched.pool_cells = target, 16384
        self.tick_ms: list[tuple[int, int, float]] = []  # (decode rows, prefill tokens, ms)
        self.first: dict = {}

    def submit(self, key, n_prompt, max_tokens):
        s = Session(key, [3 + (i * 7 + len(str(key))) % 500 for i in range(n_prompt)], max_tokens, ignore_eos=True)
        assert self.sched.submit(s).accepted
        return s

    def tick(self):
        tick = self.sched.plan()
        res = self.engine.step(tick.plan)
        self.clock.t += res.step_ms / 1e3
        decode = sum(len(c.tokens) == 1 and c.draw >= 0 for c in tick.plan.chunks)
        self.tick_ms.append((decode, tick.plan.n_tokens - decode, res.step_ms))
        for ev in self.sched.apply(self.sched.pipeline.answer(tick.t), res):
            if ev.kind == "tokens":
                self.first.setdefault(ev.session.key, self.clock.t)

    def run_until(self, pred, limit=5000):
        for _ in range(limit):
            if pred():
                return
            self.tick()
        raise AssertionError("did not get there")


def test_the_fit_recovers_a_known_cost_and_ignores_stalls():
    cost, rng = TickCost(), np.random.default_rng(0)
    for i in range(300):
        rows, cells = int(rng.integers(1, 300)), int(rng.integers(0, 8000))
        ms = BASE + PER_ROW * rows + PER_CELL * rows * cells
        cost.observe(rows, rows * float(cells), ms * (8 if i % 17 == 0 else 1))
    assert np.allclose(cost.coef, [BASE, PER_ROW, PER_CELL], rtol=0.02)
    assert cost.outliers >= 10


def test_with_decoders_each_tick_meets_the_target_and_prompts_still_move():
    node = Node(target=200.0, slow_every=23)
    for i in range(4):
        node.submit(f"d{i}", 8, 2000)
    node.run_until(lambda: len(node.first) == 4 and node.sched.cost.ready)
    burst = [node.submit(f"b{i}", 1000, 4) for i in range(4)]
    node.run_until(lambda: all(b.key in node.first for b in burst))
    during = [ms for d, p, ms in node.tick_ms[-60:] if d and p and ms < 6 * 150]  # the injected stalls aside
    assert max(during) <= 200 * 1.05, "a tick ran past the target by more than noise"
    assert np.median(during) >= 0.8 * 200, "ticks should take as many prompt tokens as fit the target"


def test_with_nobody_decoding_a_prompt_goes_in_the_biggest_chunks():
    node = Node(target=50.0, top=512)
    node.submit("warm", 40, 30)
    node.run_until(lambda: node.sched.idle)  # the model learns
    node.tick_ms.clear()
    node.submit("alone", 1500, 1)
    node.run_until(lambda: node.sched.idle)
    assert [p for _, p, _ in node.tick_ms[:3]] == [512, 512, 476]


def test_capacity_estimate_is_close_to_the_first_token_delay_idle_and_busy():
    node = Node(target=200.0)
    node.submit("warm", 300, 40)
    node.run_until(lambda: node.sched.idle)
    for label, busy in (("idle", 0), ("busy", 4)):
        for i in range(busy):
            node.submit(f"d{i}", 8, 3000)
        node.run_until(lambda: all(f"d{i}" in node.first for i in range(busy)))
        est = capacity(node.sched, prompt_tokens=1000)["ttft_ms_estimate"]
        t0 = node.clock.t
        node.submit(label, 1000, 2)
        node.run_until(lambda: label in node.first)
        measured = (node.first[label] - t0) * 1e3
        assert abs(est - measured) <= 0.25 * measured, (label, est, measured)
        node.run_until(lambda: label not in node.sched.live)


def test_capacity_reports_room_and_no_estimate_before_the_model_has_learned():
    node = Node()
    c = capacity(node.sched, prompt_tokens=100)
    assert c["free_slots"] == 8 and c["queue_room"] == 64 and c["ttft_ms_estimate"] is None
    assert c["free_kv_tokens"] == 16384 and c["max_session_tokens"] == 16384


def test_attention_counts_cells_by_layout():
    assert attention([(0, 4), (100, 1)], unified_cells=500) == 5 * 500
    assert attention([(0, 4), (100, 1)], unified_cells=0) == 4 * 4 + 101
