"""The tick cost model, the tick-time target and the capacity estimate, against a fake engine whose
step time is a known function of the plan (the clock moves by exactly that time)."""
import numpy as np
import pytest

from helpers import Clock, scheduler
from meshnode.core.capacity import capacity
from meshnode.core.costmodel import Shape, TickCost, attention, fill, fill_deterministic, shape, sized
from meshnode.core.sizing import TickTarget, prefill_room, within_target
from meshnode.core.session import Session
from meshnode.dev.fake import FakeEngine

BASE, PER_ROW, PER_CELL = 30.0, 2.0, 0.002  # ms; a unified KV: every row attends to every cell in use


def true_ms(plan, cells):
    rows = plan.n_tokens
    return BASE + PER_ROW * rows + PER_CELL * rows * cells


class Node:
    """A scheduler and a fake engine in lockstep on a clock that only the engine's steps move."""

    def __init__(self, target=200.0, top=512, slow_every=0, ratio=0.0, speed=1.0, steps_ms=0.0):
        self.clock = Clock(0.0)
        self.n = 0

        def cost(plan):
            self.n += 1
            ms = true_ms(plan, sum(self.engine._next_pos)) / speed
            return ms * 6 if slow_every and self.n % slow_every == 0 else ms  # a stall now and then

        # one decode step a tick unless `steps_ms` says otherwise, no prefix cache (prompts repeat here)
        self.engine, self.sched = scheduler(FakeEngine(n_seq_max=8, n_ctx=16384, n_batch=1024, cost_ms=cost),
                                            clock=self.clock, max_prefill_tokens_per_tick=top, pool_cells=16384,
                                            tick_target=TickTarget(target, ratio), steps_ms=steps_ms,
                                            prefix_cache="off")
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
        for ev in self.sched.apply(tick, res):
            if ev.kind == "tokens":
                self.first.setdefault(ev.session.key, self.clock.t)

    def run_until(self, pred, limit=5000):
        for _ in range(limit):
            if pred():
                return
            self.tick()
        raise AssertionError("did not get there")


def test_the_fit_is_made_when_a_prediction_is_asked_for_and_follows_every_tick_observed(monkeypatch):
    """A node that only decodes asks for no prediction: the fit (0.2-0.6 ms of the front's CPU) waits until one
    is asked for, and is then made from every tick seen meanwhile."""
    cost, fits = TickCost(), []
    real_fit = TickCost._fit
    monkeypatch.setattr(TickCost, "_fit", lambda self: fits.append(1) or real_fit(self))
    tick = lambda rows: Shape(1, rows, 0.0, 0.0)  # noqa: E731
    for i in range(12):
        cost.observe(tick(1 + i % 4), BASE + PER_ROW * (1 + i % 4))
    assert cost.ready and len(fits) == 1  # the first fit, once there are enough ticks
    for i in range(500):  # the engine got twice as slow per row, and nobody asked
        cost.observe(tick(1 + i % 4), BASE + 2 * PER_ROW * (1 + i % 4))
    assert len(fits) == 1
    assert cost.predict(tick(100)) == pytest.approx(BASE + 2 * PER_ROW * 100, rel=0.02) and len(fits) == 2
    cost.predict(tick(50))
    assert len(fits) == 2  # nothing new since: no refit


def test_a_decode_tick_is_what_ticks_of_about_its_rows_took_else_what_the_fit_says():
    """While prompts keep coming every tick carries some, so no decode-only tick of 30 rows runs: the target
    must then come from the fit, not from the one-row ticks that ran before (64 sessions arriving at once
    got one or two prompts a tick that way)."""
    cost = TickCost()
    for rows in [1, 2, 5, 9, 17, 33, 65, 129] * 3:
        cost.observe(Shape(1, rows, 0.0, 0.0), BASE + PER_ROW * rows)
    for _ in range(5):
        cost.observe(Shape(1, 1, 0.0, 0.0), 15.0, decode_only=True)  # the warm-up's lone rows, faster than the fit says
    assert cost.decode_tick_ms(Shape(1, 1, 0.0, 0.0)) == 15.0
    assert cost.decode_tick_ms(Shape(1, 3, 0.0, 0.0)) == 15.0  # the next power of two: about its rows
    assert cost.decode_tick_ms(Shape(1, 30, 0.0, 0.0)) == pytest.approx(BASE + PER_ROW * 30, rel=0.02)

def test_the_fit_recovers_a_known_cost_and_ignores_stalls():
    cost, rng = TickCost(), np.random.default_rng(0)
    for i in range(300):
        rows, cells = int(rng.integers(1, 300)), int(rng.integers(0, 8000))
        ms = BASE + PER_ROW * rows + PER_CELL * rows * cells
        cost.observe(Shape(1, rows, rows * float(cells), 0.0), ms * (8 if i % 17 == 0 else 1))
    assert np.allclose(cost.coef, [BASE, PER_ROW, PER_CELL, 0], rtol=0.02)
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


def test_a_ratio_target_bounds_the_gap_in_decode_ticks_on_a_slow_and_a_fast_engine():
    """The default target: a tick with prompt rows takes at most `ratio` decode-only ticks, so the worst
    wait between tokens is the same in ticks on an engine 5x faster, and so is the burst's length in
    ticks; a target in ms would let the fast engine's decoders wait 5x more of their ticks."""
    burst_ticks = {}
    for speed in (1.0, 5.0):
        node = Node(target=0.0, ratio=8.0, speed=speed)
        for i in range(4):
            node.submit(f"d{i}", 8, 3000)
        node.run_until(lambda: len(node.first) == 4 and node.sched.cost.ready)
        steady = np.median([ms for d, p, ms in node.tick_ms[-20:] if d and not p])
        n0 = len(node.tick_ms)
        burst = [node.submit(f"b{i}", 1000, 4) for i in range(4)]
        node.run_until(lambda: all(b.key in node.first for b in burst))
        during = [ms for d, p, ms in node.tick_ms[n0:] if d and p]
        assert max(during) <= 8 * steady * 1.05, (speed, max(during) / steady)
        assert np.median(during) >= 0.8 * 8 * steady, "ticks should take as many prompt tokens as fit the target"
        burst_ticks[speed] = len(node.tick_ms) - n0
        assert capacity(node.sched)["tick_target_ms"] == pytest.approx(8 * steady, rel=0.05)
    assert abs(burst_ticks[1.0] - burst_ticks[5.0]) <= 0.1 * burst_ticks[1.0], burst_ticks


def test_a_ratio_target_counts_the_gap_the_decoders_had_all_steps_of_their_ticks():
    """Decode ticks of several steps deliver a stream's tokens a few at a time: the burst's ticks are bounded by
    `ratio` of those gaps, not of one step (which paced a burst at twice the streams' steady gap, in chunks
    too small for the prefill to keep up with llama-server's)."""
    node = Node(target=0.0, ratio=8.0, steps_ms=200.0)  # a decode step of 4 rows is ~43 ms here: 4 a tick
    for i in range(4):
        node.submit(f"d{i}", 8, 3000)
    node.run_until(lambda: len(node.first) == 4 and node.sched.cost.ready and len(node.tick_ms) > 40)
    steady = np.median([ms for d, p, ms in node.tick_ms[-20:] if d and not p])
    step = node.sched.cost.measured_decode_ms(4)
    assert steady >= 3 * step, "the decode ticks should run several steps"
    n0 = len(node.tick_ms)
    burst = [node.submit(f"b{i}", 1000, 4) for i in range(4)]
    node.run_until(lambda: all(b.key in node.first for b in burst))
    during = [ms for d, p, ms in node.tick_ms[n0:] if d and p]
    assert max(during) <= 8 * steady * 1.05, max(during) / steady
    assert np.median(during) >= 0.8 * 8 * steady, np.median(during) / steady


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


def test_the_estimate_counts_only_the_cached_cells_that_stay_once_the_prompt_reserves_its_own():
    """On a unified pool every row attends to every cell, cached ones too; but a new session's reservation
    evicts cached entries that no longer fit, so those must not slow the replay (in a node they made the
    estimate 1.5x the measured delay)."""
    node = Node()
    node.sched.seqs.cache.scope, node.sched.seqs.pool_cells = "node", 16384
    for i in range(4):
        node.submit(f"d{i}", 8, 3100)  # 4 x 3,108 cells reserved of 16,384
    node.run_until(lambda: all(f"d{i}" in node.first for i in range(4)))
    node.submit("p0", 2000, 1)  # finished, its 2,000 cells stay cached beside the reservations...
    node.run_until(lambda: "p0" not in node.sched.live)
    reserved = node.sched.admission.kv_reserved_bytes // node.sched.budget.kv_bytes_per_token
    assert node.sched.seqs.cells == 2000 and node.sched.seqs.cached_beside(reserved + 2001) == 0  # ... until a new one
    est = capacity(node.sched, prompt_tokens=2000)["ttft_ms_estimate"]
    t0 = node.clock.t
    node.submit("new", 2000, 1)
    node.run_until(lambda: "new" in node.first)
    measured = (node.first["new"] - t0) * 1e3
    assert abs(est - measured) <= 0.1 * measured, (est, measured)

def test_capacity_reports_room_and_no_estimate_before_the_model_has_learned():
    node = Node()
    c = capacity(node.sched, prompt_tokens=100)
    assert c["free_slots"] == 8 and c["queue_room"] == 64 and c["ttft_ms_estimate"] is None
    assert c["free_kv_tokens"] == 16384 and c["max_session_tokens"] == 16384


def test_attention_counts_cells_by_layout():
    assert attention([(0, 4), (100, 1)], unified_cells=500) == 5 * 500
    assert attention([(0, 4), (100, 1)], unified_cells=0) == 4 * 4 + 101


def test_a_tick_shape_counts_llama_decode_calls_and_attention_by_layout():
    decode, prompt, short = [(10, 1), (20, 1)], (0, 100), (50, 30)
    # streams: the decode rows are one call, each chunk another; 100 rows attend as two whole tiles
    s = shape([*decode, prompt, short], unified_cells=0)
    assert (s.calls, s.rows) == (3, 132)
    assert s.attn == 11 + 21 + 128 * 100 + 30 * 80 and s.attn_small == 11 + 21 + 30 * 80
    # unified: one call of 132 rows, each attending to all 500 cells, in three tiles of 64
    u = shape([*decode, prompt, short], unified_cells=500)
    assert (u.calls, u.rows, u.attn, u.attn_small) == (1, 132, 192 * 500, 0.0)
    assert sized([*decode, prompt]) and not sized(decode) and not sized([prompt])


def test_chunks_of_one_length_share_a_call_and_cost_no_call_of_their_own_when_filled():
    """On streams llama.cpp puts equal chunks of consecutive streams in one ubatch: the prompts that arrive
    together go in one call, and filling a tick charges a call only for a new length."""
    decode, equal = [(10, 1)] * 4, [(0, 32)] * 3
    s = shape([*decode, *equal, (0, 20)], unified_cells=0)
    assert (s.calls, s.rows) == (3, 4 + 96 + 20)
    # every stream under a tile: its own row-by-row kernel
    assert s.attn == s.attn_small == 4 * 11 + 3 * 32 * 32 + 20 * 20
    assert fill(200, [32] * 8, True, True, 14) == [32] * 6  # no call charged after the first: 6 fit, the 7th has 8 rows
    assert fill(120, [32, 40, 32, 40], True, True, 14) == [32, 40, 32]  # one charge, for the 40s' call
    assert fill_deterministic(200, [(0, 32, 32)] * 8, True, 14) == [32] * 6

def test_streams_chunks_are_whole_tiles_leave_no_sliver_and_a_second_prompt_needs_a_tile():
    _, streams = scheduler(pool_cells=0)
    assert streams.sizing.cuts(180, [(0, 1000, 1000)], True) == [180]  # the last tile mostly full: kept
    assert streams.sizing.cuts(150, [(0, 1000, 1000)], True) == [128]  # 22 rows in a last tile of 64: left for a later tick
    assert streams.sizing.cuts(150, [(0, 180, 180)], True) == [116]  # not 150 and a 30-token tail: 64 are left
    assert streams.sizing.cuts(150, [(0, 100, 100), (0, 500, 500)], True) == [100]  # 50 rows left: not worth a call of their own
    assert streams.sizing.cuts(300, [(0, 100, 100), (0, 500, 500)], True) == [100, 192]
    assert streams.sizing.cuts(40, [(0, 30, 30), (0, 500, 500)], True) == [30]  # a short prompt finishing is always taken
    _, unified = scheduler(pool_cells=4096)  # one call for the whole tick: no such rules
    assert unified.sizing.cuts(150, [(0, 1000, 1000)], True) == [150] and unified.sizing.cuts(150, [(0, 100, 100), (0, 500, 500)], True) == [100, 50]


def true_cost(s):
    return 10 * s.calls + 2 * s.rows + 0.001 * s.attn + 0.01 * s.attn_small


def test_the_fit_learns_what_small_calls_cost_and_sizing_skips_them_when_a_tile_is_cheaper():
    cost, rng = TickCost(), np.random.default_rng(1)
    for _ in range(200):
        k, n, pos = int(rng.integers(1, 9)), int(rng.integers(2, 300)), int(rng.integers(0, 900))
        s = shape([(int(rng.integers(0, 900)), 1)] * k + [(pos, n)], 0)
        cost.observe(s, true_cost(s), sized=True)
    assert np.allclose(cost.coef[1:], [2, 0.001, 0.01], rtol=0.05) and 8 < cost.coef[0] < 12  # (the prior pulls)
    decode = [(100, 1)] * 4
    assert true_cost(shape([*decode, (900, 63)], 0)) > true_cost(shape([*decode, (900, 64)], 0))
    target = true_cost(shape([*decode, (900, 64)], 0)) * 1.05
    assert prefill_room(cost, TickTarget(target), 504, decode, 0, 900) == 64  # not the largest small chunk under it


def test_a_second_prompt_chunk_stays_only_if_the_tick_still_meets_the_target():
    """The room is sized for one chunk; where the first prompt finishes and the next starts, the second chunk
    is another call on streams, and it waits for the next tick when the two together would run over."""
    cost, rng = TickCost(), np.random.default_rng(1)
    for _ in range(200):
        k, n, pos = int(rng.integers(1, 9)), int(rng.integers(2, 300)), int(rng.integers(0, 900))
        s = shape([(int(rng.integers(0, 900)), 1)] * k + [(pos, n)], 0)
        cost.observe(s, true_cost(s), sized=True)
    decode, chunks = [(100, 1)] * 4, [(900, 100), (0, 128)]
    both = cost.bound(shape([*decode, *chunks], 0))
    assert within_target(cost, TickTarget(both * 1.01), decode, 0, chunks) == 2
    assert within_target(cost, TickTarget(both * 0.9), decode, 0, chunks) == 1
    assert within_target(cost, TickTarget(1.0), decode, 0, chunks) == 1  # the first always moves
    assert within_target(cost, TickTarget(), decode, 0, chunks) == 2  # fixed chunks: no target to meet


def test_the_correction_follows_sized_ticks_only_and_sizing_uses_its_high_quantile():
    cost = TickCost()
    for n in range(2, 40):
        cost.observe(shape([(0, 1), (0, 4 * n)], 0), true_cost(shape([(0, 1), (0, 4 * n)], 0)))
    assert cost.correction == cost.correction_bound == 1.0
    lone = shape([(0, 400)], 0)
    for _ in range(10):  # a lone prompt's big batches ran faster than fitted: not a sized tick
        cost.observe(lone, 0.7 * true_cost(lone))
    assert cost.correction == 1.0
    for i in range(16):  # ticks beside decoders ran 10-30 % over
        s = shape([(0, 1), (0, 100 + i)], 0)
        cost.observe(s, (1.1 + 0.2 * (i % 2)) * cost.predict(s), sized=True)
    assert 1.1 < cost.correction < cost.correction_bound <= 1.31
    s = shape([(0, 1), (0, 128)], 0)
    assert cost.bound(s) > cost.predict(s, sized=True) > cost.predict(s)


@pytest.mark.slow
def test_the_first_token_estimate_orders_prompts_and_load_as_the_engine_costs_them(tiny_model):
    """On the real model, not a fake whose cost has the fitted form: the node's estimate of a prompt's
    first-token delay grows with the prompt, idle and with four sessions decoding. How close it lands to the
    measured delay is a benchmark's to say
    (`meshnode bench burst` prints estimate and measurement side by side): a wall-clock ratio here failed
    whenever the machine was busier than at the node's start-up timing."""
    from meshnode.dev.nodeproc import NodeProcess

    with NodeProcess(tiny_model, "--kv-layout", "unified", "--ctx", "16384") as n, n.client(timeout_s=120) as c:
        idle = {k: c.status(prompt_tokens=k)["capacity"]["ttft_ms_estimate"] for k in (200, 2000)}
        for i in range(4):
            c.submit(f"d{i}", tokens=[3 + i, 4, 5], max_tokens=3000, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "tokens" and e["id"] == "d3", keep=True)
        busy = {k: c.status(prompt_tokens=k)["capacity"]["ttft_ms_estimate"] for k in (200, 2000)}
        for i in range(4):
            c.cancel(f"d{i}")
        c.collect([f"d{i}" for i in range(4)])
    print("first-token estimates, ms: idle", idle, "with four decoding", busy)
    assert 0 < idle[200] < idle[2000] and 0 < busy[200] < busy[2000]


def test_deterministic_chunks_keep_every_cell_on_the_kernel_a_cold_run_gives_it():
    from meshnode.core.costmodel import deterministic_chunk as chunk
    # a prompt of >= 64 tokens: chunks of >= 64 rows, leaving 0 or >= 64 behind
    assert chunk(504, 0, 300, 300) == 300
    assert chunk(128, 0, 300, 300) == 128 and chunk(128, 128, 300, 300) == 172 - 64 and chunk(128, 236, 300, 300) == 64
    assert chunk(64, 0, 100, 100) == 100  # 64 + 36 would leave a 36-row tail: up to 127 rows instead

    def cuts(rooms, n_prompt):
        out = []
        while sum(out) < n_prompt:
            out.append(chunk(rooms[min(len(out), len(rooms) - 1)], sum(out), n_prompt, n_prompt))
        return out

    # where the room holds one tile, the rows past the whole tiles go first, at the cheapest positions, beside
    # the next tile (or, too many for the room, half now and half next), and the prompt ends on whole tiles:
    # cut greedily, 1,000 tokens in a room of 64 ended 84 + 84 at 832 and 916, the burst's worst ticks
    assert cuts([64], 1000) == [84, 84] + [64] * 13 and cuts([10], 1000) == cuts([64], 1000)
    assert cuts([112], 1000) == [104] + [64] * 14 and cuts([64], 1020) == [94, 94] + [64] * 13
    assert chunk(112, 776, 1000, 1000) == 96 and chunk(80, 872, 1000, 1000) == 64  # a prompt met mid-way
    # a wider room takes what it holds, and leaves two tiles rather than a tail of 65-127 rows
    assert cuts([300, 250, 200, 150, 128, 100, 64], 1000) == [300, 250, 200, 122, 128]
    assert cuts([64], 185) == [93, 92]  # not 64 and a forced 121: too short for two tiles, so halves
    for n_prompt in range(64, 1500):  # every cut keeps the kernel: >= a tile, leaving 0 or >= a tile
        for room in (1, 64, 100, 127, 128, 200, 504):
            c = cuts([room], n_prompt)
            assert min(c) >= 64 and (room >= 128 or max(c) <= 127), (room, n_prompt, c)
    # a shorter prompt: any cut; generated tokens a restart recomputes: under 64 rows, after the prompt
    assert chunk(10, 0, 40, 40) == 10
    assert chunk(504, 0, 300, 330) == 300 and chunk(504, 300, 300, 330) == 30 and chunk(504, 300, 300, 500) == 63
    assert chunk(504, 0, 40, 140) == 63  # a short prompt's cells and the answer's: the per-row kernel both


def test_a_lone_decode_row_gets_a_dummy_neighbour_and_rows_beside_others_none():
    from meshnode.engine.invariant import SPLIT_KV_CELLS, LonePads, pads
    every = LonePads(True, True)
    at = lambda streams, pos=0: [(s, pos) for s in streams]  # noqa: E731
    assert pads(at([0, 1, 2]), 8, every) == [] and pads(at([3, 4]), 8, every) == []
    assert pads(at([0]), 8, every) == [1] and pads(at([7]), 8, every) == [6]
    assert pads(at([0, 2]), 8, every) == [1]  # 0 and 2 join through 1
    assert pads(at([0, 3, 7]), 8, every) == [1, 4, 6]
    for streams in ([0], [5], [0, 2, 4, 6], [1, 3, 5, 7], [0, 7]):  # every run of streams ends up with >= 2 rows
        taken = sorted(streams + pads(at(streams), 8, every))
        runs, run = [], [taken[0]]
        for s in taken[1:]:
            run = run + [s] if s == run[-1] + 1 else (runs.append(run), [s])[1]
        runs.append(run)
        assert all(len(r) >= 2 for r in runs) and len(set(taken)) == len(taken)
    deep = LonePads(False, True)  # only past SPLIT_KV_CELLS (flash attention's split-KV path)
    assert pads(at([0], SPLIT_KV_CELLS - 1), 8, deep) == [] and pads(at([0], SPLIT_KV_CELLS), 8, deep) == [1]
    assert pads([(0, 5), (3, SPLIT_KV_CELLS + 9)], 8, deep) == [4] and pads(at([0, 3]), 8, LonePads(False, False)) == []


def test_a_drafted_tick_counts_as_the_streams_gap_but_teaches_the_fit_nothing():
    """The engine adds draft rows to a decode-only tick on its own (engine/drafts.py): the tick the scheduler
    planned is not the one that ran. Its time is the streams' (the cadence a ratio target counts), but taken
    as the plan's it put the fit's costs off and counted the tick as running far over its prediction."""
    def run(drafts: str):
        engine, sched = scheduler(FakeEngine(n_seq_max=8, n_ctx=8192, n_batch=1024, cost_ms=lambda plan:
                                             true_ms(plan, 0)), prefix_cache="off", steps_ms=0.0)
        for i in range(4):
            sched.submit(Session(f"s{i}", [3 + i, 4, 5] * (20 + 9 * i), 200, ignore_eos=True))
        decode_ms = []
        for n in range(160):
            tick = sched.plan()
            res = engine.step(tick.plan)
            if drafts != "none" and n % 3 == 0 and all(len(c.tokens) == 1 for c in tick.plan.chunks):
                res.step_ms *= 4  # what 4 x 12 draft rows took beside the planned rows
                res.drafted = 48 if drafts == "said" else 0
            if all(len(c.tokens) == 1 for c in tick.plan.chunks):
                decode_ms.append(res.step_ms)
            sched.apply(tick, res)
        return sched.cost, decode_ms

    (plain, _), (said, streams_had), (unsaid, _) = run("none"), run("said"), run("unsaid")
    prompt = shape([(0, 1)] * 4 + [(50, 300)], 0)
    assert said.predict(prompt) == pytest.approx(plain.predict(prompt), rel=0.02)
    assert said.outliers == plain.outliers == 0
    assert unsaid.outliers > 0 and abs(unsaid.predict(prompt) / plain.predict(prompt) - 1) > 0.1  # the old way
    four = shape([(0, 1)] * 4, 0)
    assert said.decode_tick_ms(four) == pytest.approx(float(np.median(streams_had[-16:])))


def test_a_burst_target_counts_the_steps_the_budget_fits_not_the_one_its_slack_adds():
    """8 rows at 27 ms a step run two steps a tick under decode_steps_ms 50 (its slack: 54 ms); a tick with prompt
    rows beside them is bounded by 8 one-step ticks, as before the slack, where 4 rows at 20 ms keep their two."""
    eight, four = shape([(100, 1)] * 8, 0), shape([(100, 1)] * 4, 0)
    cost = TickCost()
    for _ in range(5):
        cost.observe(eight, 27.0, decode_only=True, steps=2)
        cost.observe(four, 20.0, decode_only=True, steps=2)
    assert cost.cadence_ms(eight) == 54.0 and cost.cadence_ms(four) == 40.0
    assert TickTarget(0.0, 8.0, 50.0).bound_ms(cost, eight) == 8 * 27.0
    assert TickTarget(0.0, 8.0, 50.0).bound_ms(cost, four) == 8 * 40.0
    assert TickTarget(0.0, 8.0).bound_ms(cost, eight) == 8 * 54.0  # a target told of no budget counts every step
    assert TickTarget(0.0, 8.0, 0.0).bound_ms(cost, eight) == 8 * 27.0  # one step a tick: the step
