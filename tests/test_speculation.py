"""The speculative-decoding policy (core/speculation.py): how many drafts a tick carries, with no engine."""
from meshnode.core.speculation import Acceptance, RowCost, Yield, draft_len, expected_skips, in_effect

CPU = RowCost([(1, 21.0), (2, 34.0), (4, 60.0), (8, 107.0), (16, 210.0)])  # a row costs about what a decode does
GPU = RowCost([(1, 6.0), (2, 6.1), (4, 6.2), (8, 6.5), (16, 7.0), (64, 9.0), (128, 14.0)])  # rows nearly free


def test_right_drafts_pay_where_rows_are_nearly_free_and_wrong_ones_never_do():
    assert draft_len([0.9], 1, GPU, 16) >= 8  # a lone session on a GPU: long drafts
    assert draft_len([0.01], 1, GPU, 16) == 0  # drafts that are hardly ever right cost rows for nothing
    assert draft_len([0.05], 1, GPU, 16) == 1  # right 1 time in 20: one row at 2 % more pays, a second does not
    assert draft_len([0.9], 1, GPU, 4) == 4  # never past draft_max
    assert draft_len([0.999], 1, GPU, 16, k_min=20) == 0  # draft_min past what is allowed: no drafts


def test_more_right_drafts_mean_more_drafts_and_more_sessions_mean_fewer():
    ks = [draft_len([a], 1, CPU, 16) for a in (0.3, 0.6, 0.8, 0.95, 0.999)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] >= 4, ks
    assert draft_len([0.9] * 8, 8, CPU, 16) == 0  # 8 busy sessions on a CPU: batched throughput first
    assert draft_len([0.8] * 8, 8, GPU, 16) > 0  # ... where rows are nearly free, drafting still pays
    assert draft_len([0.999] * 2, 2, CPU, 16) <= draft_len([0.999], 1, CPU, 16)


def test_a_row_that_is_paid_for_anyway_carries_a_draft():
    """Deterministic mode pads a lone decode row with a second row: one draft costs nothing."""
    assert draft_len([0.01], 2, CPU, 16, free=1) == 1 and draft_len([0.01], 2, CPU, 0, free=1) == 0


def test_a_tick_is_skipped_only_where_every_session_is_ahead():
    assert expected_skips([1.0], 3) == 3.0 and expected_skips([0.5], 2) == 0.5 + 0.25
    assert expected_skips([0.5, 0.5], 1) == 0.25 and expected_skips([], 3) == 3.0


def test_acceptance_follows_recent_drafts_and_row_cost_interpolates():
    a = Acceptance()
    assert a.rate == 0.5
    for _ in range(5):
        a.record(8, 8)  # a copy: every draft right
    assert a.rate > 0.95
    for _ in range(10):
        a.record(0, 8)  # then new text: the first draft wrong each time
    assert a.rate < 0.2
    assert CPU(3) == 47.0 and CPU(32) == 210.0 + 16 * (210.0 - 107.0) / 8  # between points, and past the last two
    assert RowCost()(5) == 5.0 and RowCost([(4, 8.0)])(2) == 4.0
    seen = RowCost([(1, 5.0), (2, 10.0), (4, 12.0)])
    seen.observe(2, 20.0)
    assert seen(2) == 20.0  # the first tick in service replaces the warm calibration's figure
    seen.observe(2, 10.0)
    assert 10.0 < seen(2) < 20.0  # later ones move it a step at a time
    assert seen(4) > 12.0  # a count not seen yet: its seed, scaled as the seen ones ran from theirs
    seen.observe(4, 8.0)
    assert seen(4) == seen(2)  # never less than a smaller count's


def test_row_cost_of_unseen_counts_follows_service():
    """The calibration timed 3 rows warm at 1.5x one; in service (between single rows) they take 2x: the
    policy must not keep believing the warm figure for the counts it has not tried yet (4, 6)."""
    cost = RowCost([(1, 6.0), (2, 8.0), (3, 9.0), (4, 10.0), (6, 12.0)])
    assert draft_len([[0.6, 0.36, 0.2, 0.1, 0.05]], 1, cost, 5) > 0  # the warm figures: drafts pay
    for _ in range(3):
        cost.observe(1, 6.0)
        cost.observe(3, 12.0)
    assert cost(4) > 10.0 * 1.2 and cost(6) > 12.0 * 1.2
    assert draft_len([[0.6, 0.36, 0.2, 0.1, 0.05]], 1, cost, 5) == 0  # in service they do not


def test_drafting_needs_per_sequence_streams():
    assert in_effect("auto", "streams") == ("auto", "")
    mode, why = in_effect("lookup", "unified")
    assert mode == "off" and why.startswith("spec: off on the unified KV layout")
    assert in_effect("off", "unified") == ("off", "")


def test_a_session_whose_drafts_fall_short_of_their_promise_stops_drafting_and_tries_again_later():
    """Chains learned from first guesses promise runs that free text ends sooner: where a session's drafted
    ticks keep giving a fraction of the skips their chains promised, its chain is scaled down until drafts
    no longer pay; the evidence fades tick by tick, so drafting comes back (a copy may begin)."""
    cost = RowCost([(1, 6.0), (2, 12.0), (4, 17.0), (8, 22.0), (16, 28.0)])
    chain = [0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35]
    assert draft_len([chain], 1, cost, 8) > 0  # as promised, drafts pay
    y = Yield()
    for _ in range(3):
        y.tick()
        y.record(sum(chain), 1)  # each drafted tick kept one token of the ~4.7 promised
    assert draft_len([[p * y.factor for p in chain]], 1, cost, 8) == 0
    for _ in range(80):  # undrafted ticks: the evidence halves every ~23
        y.tick()
    assert draft_len([[p * y.factor for p in chain]], 1, cost, 8) > 0
    good = Yield()
    good.record(sum(chain), 8)  # a copy: more than promised is never taken as more than the chain says
    assert good.factor == 1.0


def test_calibration_points_never_make_more_rows_cheaper():
    """The start-up calibration times each shape once (a chunk of 16 rows at position 0 beside 8 sequences'
    rows at depth): a count timed cheaper than fewer rows is taken at their cost, so long drafts do not look
    cheaper per row than they are (measured: 16 rows seeded at 23 ms beside 8 at 25, in service 31-40)."""
    cost = RowCost([(1, 6.3), (2, 12.4), (4, 21.0), (8, 24.0), (16, 22.3), (4, 16.0)])
    assert cost(16) == 24.0 and cost(4) == 21.0 and cost(12) == 24.0 and cost(2) == 12.4
