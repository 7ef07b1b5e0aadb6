"""The llama.cpp batch engine on the tiny model, checked against itself and the numpy oracle."""
import logging

import numpy as np
import pytest

from helpers import engine_config, generate, prompt
from meshnode.core.costmodel import Shape, TickCost
from meshnode.core.types import GREEDY, InvalidPlan, Keep, Plan, Sampling, SeqChunk, Share
from meshnode.engine.drafts import Lookup
from meshnode.engine.llama import LlamaEngine
from meshnode.dev.reference import ReferenceEngine

LENGTHS = [1, 3, 7, 12, 20, 33, 50, 64]


@pytest.fixture(scope="module")
def engine(tiny_model):
    with LlamaEngine(engine_config(tiny_model, n_seq_max=8, ctx=2048, threads=2)) as e:
        yield e


@pytest.fixture(scope="module")
def reference(tiny_model):
    return ReferenceEngine(tiny_model, n_seq_max=8)


def test_prompt_lookup_drafts_what_followed_the_latest_longest_suffix_and_forgets_dropped_history():
    d = Lookup()
    h = [1, 2, 3, 1, 2, 4, 1, 2]
    assert d.propose(0, h, 3) == [4, 1, 2]  # (1, 2) came twice, first followed by 3, then by 4: the latest
    assert d.propose(0, h + [9], 3) == []  # (2, 9) never came: nothing to propose
    assert d.propose(2, [5, 6, 7, 5, 6], 5) == [7, 5, 6, 7, 5]  # a repeating run repeats on through the drafts
    assert d.propose(2, [5, 6, 7, 5, 6], 0) == [] and d.propose(1, [7], 4) == []
    longest = Lookup()  # (3, 1, 2) came before, followed by 8; the pair (1, 2) last by 4: the longer suffix wins
    assert longest.propose(0, [3, 1, 2, 8, 1, 2, 4, 3, 1, 2], 1) == [8]
    d.forget(0, keep=3)  # the sequence kept its first 3 positions (a prefix-cache Keep), then went elsewhere
    assert d.propose(0, [1, 2, 3, 1, 2], 2) == [3, 1]  # (3, 1, 2) -> 4 came from the history dropped
    d.forget(0, keep=10)  # past what was indexed: nothing to forget
    assert d.propose(0, [1, 2, 3, 1, 2, 3, 1], 2) == [2, 3]


def test_engine_reports_its_shape(engine):
    assert engine.n_vocab == 512 and engine.n_seq_max == 8 and engine.eos == 2
    assert engine.weight_bytes > 8_000_000
    assert engine.recipe_fingerprint.startswith("mn1-")
    # 4 layers x 2 KV heads x 64 dims x (K + V) x f16
    assert engine.kv_bytes_per_token == 4 * 128 * 2 * 2


def test_eight_sequences_batched_equal_each_alone(engine):
    prompts = {i: prompt(n, i) for i, n in enumerate(LENGTHS)}
    alone_logits, batched_logits = {}, {}
    alone = generate(engine, prompts, 10, together=False, logits_out=alone_logits)
    batched = generate(engine, prompts, 10, together=True, logits_out=batched_logits)
    assert batched == alone
    diff = max(float(np.max(np.abs(a - b))) for s in prompts
               for a, b in zip(alone_logits[s], batched_logits[s]))
    print(f"max abs logit diff batched vs alone: {diff:.2e}")
    assert diff < 1e-2
    for toks in batched.values():  # non-degenerate: not one token repeated
        assert len(set(toks)) > 1


def test_mixed_ticks_and_chunk_size_do_not_change_tokens(engine):
    prompts = {0: prompt(5, 1), 1: prompt(40, 2), 2: prompt(17, 3)}
    reference_tokens = generate(engine, prompts, 8, together=False)
    for chunk in (1, 4, 16):
        assert generate(engine, prompts, 8, chunk=chunk, together=True) == reference_tokens


def test_release_frees_kv_and_the_id_is_reusable(engine):
    engine.step(Plan([SeqChunk(3, 0, np.array(prompt(9), np.int32), draw=0)], [3]))
    assert engine.seq_pos_max(3) == 8
    engine.step(Plan([], [3]))
    assert engine.seq_pos_max(3) == -1
    out = engine.step(Plan([SeqChunk(3, 0, np.array(prompt(4), np.int32), draw=0)]))
    assert 0 <= out.tokens[3] < engine.n_vocab and engine.seq_pos_max(3) == 3
    engine.step(Plan([], [3]))


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    s1, s2 = Sampling(0.9, 40, 0.95, 1234), Sampling(0.9, 40, 0.95, 99)
    prompts = {0: prompt(6, 7), 1: prompt(11, 8)}
    alone = generate(engine, prompts, 12, together=False, sampling={0: s1, 1: s1})
    batched = generate(engine, prompts, 12, together=True, sampling={0: s1, 1: s1})
    assert alone == batched
    other = generate(engine, {0: prompts[0]}, 12, sampling={0: s2})
    assert other[0] != alone[0]


@pytest.mark.parametrize("bad, why", [
    (Plan([SeqChunk(0, 0, np.array([512], np.int32), 0)]), "token id"),
    (Plan([SeqChunk(0, 0, np.array([-1], np.int32), 0)]), "token id"),
    (Plan([SeqChunk(0, 5, np.array([4], np.int32), 0)]), "expected 0"),
    (Plan([SeqChunk(8, 0, np.array([4], np.int32), 0)]), "sequence id"),
    (Plan([SeqChunk(0, 0, np.array([4], np.int32)), SeqChunk(0, 1, np.array([4], np.int32))]), "twice"),
    (Plan([SeqChunk(0, 0, np.zeros(600, np.int32))]), "n_batch"),
    (Plan([SeqChunk(0, 0, np.array([], np.int32))]), "empty"),
    (Plan([], [9]), "release"),
    (Plan([SeqChunk(0, 0, np.array([[4, 5]], np.int32))]), "1-d integer"),
    (Plan([SeqChunk(0, 0, np.array([4.0, 5.0]))]), "1-d integer"),
    (Plan([SeqChunk(0, 0, np.array(4, np.int32))]), "1-d integer"),
])
def test_bad_plans_are_refused_and_the_engine_keeps_working(engine, bad, why):
    engine.step(Plan([], list(range(8))))
    with pytest.raises(InvalidPlan, match=why):
        engine.step(bad)
    assert generate(engine, {0: prompt(3)}, 2)[0]


def test_rc1_no_kv_slot_comes_back_as_cache_miss(tiny_model):
    with LlamaEngine(engine_config(tiny_model, n_seq_max=2, ctx=256, threads=1)) as e:
        e.step(Plan([SeqChunk(0, 0, np.array(prompt(200), np.int32), 0)]))
        res = e.step(Plan([SeqChunk(1, 0, np.array(prompt(120), np.int32), 0)]))
        assert res.cache_miss == [1] and e.seq_pos_max(1) == -1
        assert e.seq_pos_max(0) == 199  # the other sequence is untouched


def test_kv_bytes_per_token_matches_what_llama_cpp_allocates(tiny_model, caplog):
    """llama.cpp logs the KV buffer it allocates; per cell it must equal our figure."""
    import re

    with caplog.at_level(logging.DEBUG, logger="meshnode.llama"):
        with LlamaEngine(engine_config(tiny_model, n_seq_max=4, ctx=1024, threads=1)) as e:
            per_token = e.kv_bytes_per_token
            e.step(Plan([SeqChunk(0, 0, np.array(prompt(32), np.int32))]))
            small = e.state_seq_size(0)
            e.step(Plan([SeqChunk(0, 32, np.array(prompt(64), np.int32))]))
            large = e.state_seq_size(0)
    m = re.search(r"size = +([0-9.]+) MiB \( *(\d+) cells", caplog.text)
    assert m, "llama.cpp did not log its KV cache size"
    assert float(m.group(1)) * 2**20 == int(m.group(2)) * per_token
    # a saved sequence state holds each cell's K and V rows plus 12 bytes of cell metadata
    assert (large - small) / 64 == per_token + 12


def test_llama_cpp_matches_the_numpy_reference(tiny_model, reference):
    """Logits agree at every position for single and batched sequences: RoPE, GQA, isolation.

    f32 KV and no flash attention, so llama.cpp computes in f32 like the oracle
    (its CPU flash attention rounds Q and V to f16: about 5e-3 here).
    """
    prompts = {0: prompt(1, 1), 1: prompt(7, 2), 2: prompt(19, 3)}
    got, want = {}, {}
    cfg = engine_config(tiny_model, n_seq_max=8, ctx=1024, threads=1, type_k="f32", type_v="f32", flash_attn="off")
    with LlamaEngine(cfg) as engine:
        generate(engine, prompts, 6, chunk=5, together=True, logits_out=got)
    generate(reference, prompts, 6, chunk=5, together=True, logits_out=want)
    diffs = [float(np.max(np.abs(a - b))) for s in prompts for a, b in zip(got[s], want[s])]
    print(f"llama.cpp vs numpy reference: max abs logit diff {max(diffs):.2e} over {len(diffs)} rows")
    assert len(diffs) == 18 and max(diffs) < 1e-3


def test_reference_engine_step_contract(reference):
    out = generate(reference, {0: prompt(4)}, 3)
    assert len(out[0]) == 3
    with pytest.raises(InvalidPlan):
        reference.step(Plan([SeqChunk(0, 7, np.array([4], np.int32), 0)]))


def test_logits_are_spread_enough(engine):
    logits = {}
    generate(engine, {i: prompt(5 + i, i) for i in range(4)}, 16, logits_out=logits)
    margins = [float(np.diff(np.sort(row)[-2:])[0]) for rows in logits.values() for row in rows]
    median = float(np.median(margins))
    print(f"median top-1 margin: {median:.3f}")
    assert median > 0.05


def test_seqmap_keeps_the_live_sequences_on_consecutive_streams():
    from meshnode.engine.seqmap import SeqMap

    m = SeqMap(8)
    assert [m[s] for s in (5, 1, 7, 0)] == [0, 1, 2, 3]  # first use: lowest free stream
    assert m.drop(1) == 1 and m.drop(1) is None
    assert m.arrange([5, 7, 0]) == [(3, 1)] and m.phys == {5: 0, 0: 1, 7: 2}  # a gap: the highest moves in
    assert m.arrange([5, 0, 7]) == [] and m.arrange([5, 0]) == []  # together already: nothing moves

    # what the prefix cache leaves: four cached conversations on 0, 2, 3, 4, four new sessions; the
    # lowest free streams (1, 5, 6, 7) would split their decode rows in two ubatches and a lone row
    m = SeqMap(8)
    for s, p in zip((10, 11, 12, 13), (0, 2, 3, 4)):
        m.phys[s] = p
        m.free.remove(p)
    assert m.arrange([20, 21, 22, 23]) == [(4, 1)]  # one cached stream out of the way
    assert sorted(m.phys[s] for s in (20, 21, 22, 23)) == [4, 5, 6, 7] and m.phys[13] == 1 and m.free == []

    # a session ended and its stream is cached in the middle: it moves out, the live one beyond moves in
    m = SeqMap(8)
    for s in range(4):
        m[s]
    assert m.arrange([0, 1, 3]) == [(2, 4), (3, 2)] and m.phys == {0: 0, 1: 1, 2: 4, 3: 2}

    m = SeqMap(4)  # every stream in use: no cached one can move out, nothing moves
    for s in range(4):
        m[s]
    assert m.arrange([0, 1, 3]) == [] and m.phys == {0: 0, 1: 1, 2: 2, 3: 3}


def test_streams_packed_after_sessions_end_keep_their_kv(tiny_model):
    """Four of eight sequences end; the others move onto consecutive streams (stream copies) and go on
    decoding as if nothing moved: compared with the same run where nothing is moved."""
    prompts = {s: np.array(prompt(40 + 7 * s, s), np.int32) for s in range(8)}

    def run(pack):
        cfg = engine_config(tiny_model, n_seq_max=8, ctx=8 * 256, threads=1, kv_layout="streams")
        with LlamaEngine(cfg) as e:
            if not pack:
                e._ids.arrange = lambda live: []
            for s, p in prompts.items():
                e.step(Plan([SeqChunk(s, 0, p, draw=0)]))
            out, release = [], [0, 2, 3, 5]
            for k in range(6):
                got = e.logits_for(Plan([SeqChunk(s, len(prompts[s]) + k, np.array([9 + k], np.int32), draw=k + 1)
                                         for s in (1, 4, 6, 7)], release))
                out.append(got)
                release = []
            return out, dict(e._ids.phys), {s: e.seq_pos_max(s) for s in (1, 4, 6, 7)}

    (packed, phys, pos), (control, phys0, pos0) = run(True), run(False)
    assert sorted(phys.values()) == [4, 5, 6, 7] and sorted(phys0.values()) == [1, 4, 6, 7]  # one move: 1 -> 5
    assert pos == pos0 == {s: len(prompts[s]) + 5 for s in (1, 4, 6, 7)}
    for a, b in zip(packed, control):
        for s in a:
            np.testing.assert_allclose(a[s], b[s], atol=1e-2)  # batch-shape noise only


@pytest.mark.parametrize("layout", ["unified", "streams"])
def test_reused_kv_continues_like_a_cold_prefill(tiny_model, layout):
    """Keep (trim a sequence to its first n cells) and Share (copy them to another) leave the KV a
    cold prefill of those tokens would have: the continuation's logits agree, greedy tokens match."""
    base = np.array(prompt(60, 1), np.int32)
    turn = np.concatenate([base[:50], np.array(prompt(12, 2), np.int32)])

    def greedy(e, seq, pos, tokens, kv=(), n=8):
        out, step = [], Plan([SeqChunk(seq, pos, tokens, draw=0, sampling=GREEDY)], kv=list(kv))
        for k in range(n):
            logits = e.logits_for(step)[seq]
            out.append(logits)
            tok = np.array([int(np.argmax(logits))], np.int32)
            step = Plan([SeqChunk(seq, pos + len(tokens) + k, tok, draw=k + 1)])
        return out

    cfg = engine_config(tiny_model, n_seq_max=4, ctx=4 * 256, threads=1, kv_layout=layout)
    with LlamaEngine(cfg) as e:
        cold = greedy(e, 3, 0, turn)
        greedy(e, 0, 0, base)
        shared = greedy(e, 1, 50, turn[50:], kv=[Share(0, 1, 50)])
        kept = greedy(e, 0, 50, turn[50:], kv=[Keep(0, 50)])
        assert e.seq_pos_max(0) == e.seq_pos_max(1) == e.seq_pos_max(3) == len(turn) + 6
    for got in (shared, kept):
        assert [int(np.argmax(x)) for x in got] == [int(np.argmax(x)) for x in cold]
        for a, b in zip(got, cold):
            np.testing.assert_allclose(a, b, atol=1e-2)


def test_calibration_times_known_shapes_and_leaves_the_engine_empty(tiny_model, monkeypatch):
    from meshnode.engine import calibration

    monkeypatch.setattr(calibration, "CHUNKS_BUDGET_MS", 1e12)  # the time bounds, tested below, out of the way:
    monkeypatch.setattr(calibration, "DEPTH_BUDGET_MS", 1e12)  # the schedule is the same on a busy machine
    monkeypatch.setattr(calibration, "MIXED_BUDGET_MS", 1e12)
    with LlamaEngine(engine_config(tiny_model, n_seq_max=4, ctx=1024, threads=1)) as e:
        points = e.calibrate()
        # chunks at 0, then seq 0 filled to half its context (512) and decode rows beside it there
        # and 64-, 128- and 256-token chunks beside 2 decode rows: (calls, rows, attn, attn_small, sized, ms)
        assert [p[1] for p in points] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 256, 256, 2, 4, 66, 130, 258]
        assert all(p[-1] > 0 for p in points) and points[7][2] == 128 * 128  # rows x cells (unified)
        # (a partial last tile of 64 rows counts whole)
        assert [p[2] for p in points[10:]] == [256 * 256, 256 * 512, 2 * 514, 4 * 516, 128 * 578, 192 * 642, 320 * 770]
        assert [p[3] > 0 for p in points] == [True] * 6 + [False] * 6 + [True, True] + [False] * 3  # under 64 rows
        assert [p[4] for p in points] == [False] * 14 + [True] * 3
        assert {c for c, *_ in points} == {1}  # one llama_decode each, on a unified KV
        assert all(e.seq_pos_max(s) < 0 for s in range(4))
        cost = TickCost()
        for p in points:
            cost.observe(Shape(*p[:4]), p[5], p[4])
        assert cost.ready and cost.predict(Shape(1, 256, 256 * 256, 0)) > cost.predict(Shape(1, 1, 0, 1))
    with LlamaEngine(engine_config(tiny_model, n_seq_max=4, ctx=1024, threads=1, kv_layout="streams")) as e:
        points = e.calibrate()  # 256 cells a stream: too shallow to fill; the chunk beside decode rows is a 2nd call
        assert [p[:2] for p in points[-5:]] == [(1, 2), (1, 4), (2, 66), (2, 130), (2, 257)]
        assert all(e.seq_pos_max(s) < 0 for s in range(4))


class _Rows:
    """An engine whose every tick costs 1 ms a row: the calibration's budgets judged on exact times."""
    n_vocab, n_batch, n_ctx_seq, n_seq_max = 100, 512, 4096, 4

    class cfg:
        kv_layout = "unified"

    def step(self, plan):
        from meshnode.core.types import StepResult

        res = StepResult()
        res.step_ms = float(sum(len(c.tokens) for c in plan.chunks))
        return res


def test_calibration_foresees_the_next_chunk_instead_of_overrunning_its_budget_by_it(monkeypatch):
    from meshnode.engine import calibration

    monkeypatch.setattr(calibration, "CHUNKS_BUDGET_MS", 100.0)  # 1..32 rows take 63 ms; 64 more would pass it
    monkeypatch.setattr(calibration, "DEPTH_BUDGET_MS", 300.0)  # 256 rows deep fits, 512 does not
    monkeypatch.setattr(calibration, "MIXED_BUDGET_MS", 200.0)  # 66 + 130 rows fit, 258 more do not
    points = calibration.calibrate(_Rows())
    assert [p[1] for p in points] == [1, 2, 4, 8, 16, 32, 256, 2, 4, 66, 130]
    assert [p[-1] for p in points] == [p[1] for p in points]


def test_calibration_stops_growing_chunks_and_stays_shallow_when_its_time_is_spent(tiny_model, monkeypatch):
    """A big model on few cores: past CHUNKS_BUDGET_MS of ticks no larger chunk is timed (8 rows are
    always), the deep fill takes the deepest of DEPTHS that fits DEPTH_BUDGET_MS, or none, and of the
    chunks beside decode rows only those that fit MIXED_BUDGET_MS (the smallest always)."""
    from meshnode.engine import calibration

    monkeypatch.setattr(calibration, "CHUNKS_BUDGET_MS", 0.0)
    monkeypatch.setattr(calibration, "DEPTH_BUDGET_MS", 0.0)
    monkeypatch.setattr(calibration, "MIXED_BUDGET_MS", 0.0)
    with LlamaEngine(engine_config(tiny_model, n_seq_max=4, ctx=1024, threads=1)) as e:
        points = e.calibrate()
    # chunks of 1-8 rows, no deep fill, then 2 and 4 decode rows at position 0 and one chunk beside 2 of them
    assert [p[1] for p in points] == [1, 2, 4, 8, 2, 4, 66]
