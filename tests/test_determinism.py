"""Deterministic mode: a session's numbers are the same whatever shares its ticks, or the node refuses.

On the build CI installs (the stock wheel, llamafile on), for every weight format it accepts, each
case holds bitwise: np.array_equal on logits in one process, exact tokens, log-probabilities and text
through the scheduler and through a node, in crowds, across an engine kill and on a prefix-cache hit.
Other formats, and a CPU where the start-up self-check sees a difference, are refused in one line.
"""
import os
import random
import signal
import time
from collections import Counter

import numpy as np
import pytest

from helpers import engine_config, history, logprob_entries, promised, scenario, serve
from meshnode.core import reasons as R
from meshnode.core.speculation import RowCost
from meshnode.core.types import GREEDY, FatalEngineError, Plan, Sampling, SeqChunk
from meshnode.dev.nodeproc import NodeProcess
from meshnode.engine import invariant, llamacpp
from meshnode.engine.config import AMX_MAX_ROWS
from meshnode.engine.llama import LlamaEngine
from meshnode.ops.models import make_model

CASES = [("f32", "tiny", None), ("f16", "tiny-f16", None), ("q8_0", "tiny-f16", "q8_0"),
         ("q4_k_m", "tiny-f16", "q4_k_m"), ("q4_1", "tiny-f16", "q4_1")]
CHUNK = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("det")
    return {name: str(make_model(d / f"{name}.gguf", preset, 0, quant)) for name, preset, quant in CASES}


@pytest.fixture(scope="module")
def problems(models):
    """What each model's engine says of deterministic mode on this CPU ("" where it holds): the start-up
    self-check is the judge, so a CPU where the rules fail skips the bitwise cases with its words."""
    out = {}
    for name, path in models.items():
        try:
            with engine(path):
                out[name] = ""
        except FatalEngineError as e:
            out[name] = str(e)
    return out


def holding(problems, name, models):
    """Where docs/determinism.md promises the mode for this format on this CPU, the engine refusing it is a
    failure (a regression of the default mode must not turn into skips); elsewhere a skip, in its words."""
    if problems[name] and promised(models[name]):
        pytest.fail(f"{name}: deterministic mode is promised on this CPU and format, the engine refused: "
                    f"{problems[name]}")
    if problems[name]:
        pytest.skip(f"{name}: deterministic mode does not hold here (the node runs without it): {problems[name]}")


def engine(path, deterministic=True, n_seq_max=8, **settings):
    return LlamaEngine(engine_config(path, **{"n_seq_max": n_seq_max, "ctx": 4096, "n_batch": 512, "threads": 1,
                                              "kv_layout": "unified" if deterministic is False else "streams",
                                              "deterministic": deterministic, **settings}))


# sequence 0's prompt: its 41 tokens all in a stream of under 256 cells, or all past it (engine/invariant.py,
# SPLIT_KV_CELLS: flash attention's split-KV path for a lone row)
DEPTHS = {"shallow": 37, "deep": 260}


def logits_of_seq0(e, crowd_seed=None, ticks=41, prompt=37):
    """Sequence 0's logits at each of its first `ticks` generated tokens (greedy) after a `prompt`-token
    prompt, with seven neighbours that start, prefill, decode, finish and start again at random when
    `crowd_seed` is given (as many as the engine has sequences)."""
    rng = random.Random(crowd_seed)
    e.step(Plan([], list(range(e.n_seq_max))))
    seqs = {0: {"toks": [3 + (k * 37) % 500 for k in range(prompt)], "cached": 0, "gen": 0, "left": 10 ** 9}}
    out = []
    while len(out) < ticks:
        release = []
        if crowd_seed is not None:
            for s in range(1, e.n_seq_max):
                if s not in seqs and rng.random() < 0.3:
                    seqs[s] = {"toks": [3 + rng.randrange(500) for _ in range(rng.choice([1, 5, 20, 40]))],
                               "cached": 0, "gen": 0, "left": rng.randrange(1, 15)}
                    release.append(s)
        chunks = []
        for s, st in seqs.items():
            n = min(CHUNK, len(st["toks"]) - st["cached"])
            end = st["cached"] + n == len(st["toks"])
            chunks.append(SeqChunk(s, st["cached"], np.array(st["toks"][st["cached"]:st["cached"] + n], np.int32),
                                   draw=st["gen"] if end else -1, sampling=GREEDY if st["cached"] == 0 else None))
        got = e.logits_for(Plan(chunks, release))
        for c in chunks:
            st = seqs[c.seq_id]
            st["cached"] = c.pos + len(c.tokens)
            if c.draw >= 0:
                st["toks"].append(int(np.argmax(got[c.seq_id])))
                st["gen"] += 1
                st["left"] -= 1
                if c.seq_id == 0:
                    out.append(got[0])
                elif st["left"] <= 0:
                    del seqs[c.seq_id]
    return out


def accepted(models):
    return [n for n, _, _ in CASES if not llamacpp.deterministic_problem(models[n])]


def test_every_weight_format_the_tests_prove_is_accepted_and_others_refused_in_one_line(models, tmp_path):
    assert accepted(models) == [c[0] for c in CASES]  # each is proven below, on the build CI installs
    q4_0 = str(make_model(tmp_path / "q4_0.gguf", "tiny-f16", 0, "q4_0"))
    problem = llamacpp.deterministic_problem(q4_0)
    assert problem.startswith("deterministic: not for Q4_0 weights") and "\n" not in problem
    with pytest.raises(ValueError, match="deterministic: not for Q4_0"):
        engine(q4_0)



@pytest.mark.parametrize("amx", [False, True])
def test_extra_weight_buffers_only_where_numbers_hold_and_never_quantized_ones_on_amx(models, monkeypatch, amx):
    """Repacked quantized weights change a row's kernel with its crowd, and AMX buffers crash on quantized
    weights; AMX's f16 path keeps a row's bits (tested below), is faster than tinyBLAS for a few rows and slower
    for more, and f32 weights stay put. Where the weights sit in AMX buffers the recipe says so."""
    monkeypatch.setattr(llamacpp, "amx_crashes", lambda: amx)

    def cfg(name, det, n=AMX_MAX_ROWS):
        return engine_config(models[name], n_seq_max=n, kv_layout="streams", deterministic=det)
    got = {(n, det): cfg(n, det).extra_buffers for n, _, _ in CASES for det in (True, False)}
    invariant_q8 = llamacpp.invariant_repack({"Q8_0"})  # patches/0001's x86 kernels (tests/test_kernels.py)
    assert got == {(n, det): (n in ("f32", "f16")) if amx else not det or (n == "q8_0" and invariant_q8)
                   for n, _, _ in CASES for det in (True, False)}
    assert cfg("f16", False, AMX_MAX_ROWS + 1).extra_buffers is not amx
    recipe = cfg("f16", True).recipe()
    monkeypatch.setattr(llamacpp, "amx_crashes", lambda: not amx)
    assert cfg("f16", True).recipe() != recipe and cfg("q8_0", True).recipe() == cfg("q8_0", True).recipe()


@pytest.mark.slow
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_a_sequence_is_bitwise_the_same_alone_and_in_any_crowd(models, problems, name, depth):
    holding(problems, name, models)
    with engine(models[name], threads=2 if depth == "deep" else 1) as e:  # one thread splits no KV
        alone = logits_of_seq0(e, prompt=DEPTHS[depth])
        crowds = [logits_of_seq0(e, seed, prompt=DEPTHS[depth]) for seed in range(3)]
    assert len(alone) == 41
    for crowd in crowds:
        assert all(np.array_equal(a, b) for a, b in zip(alone, crowd))


@pytest.mark.slow
def test_the_start_up_check_pads_only_the_lone_rows_whose_kernels_differ(models, problems):
    """Where the CPU is one the mode is promised on: q8_0 weights sum one column as they sum several, so
    a lone row needs a padding row only past SPLIT_KV_CELLS on an f16 K and V cache (flash attention's
    split-KV path), and none with a q8_0 K; f32 weights need one everywhere. Dropping the deep padding row
    changes a q8_0 sequence's logits past SPLIT_KV_CELLS: the pads found are needed, not decoration. The split
    path splits the cells over the threads: on one thread it sums as the per-row kernel does."""
    holding(problems, "q8_0", models)
    holding(problems, "f32", models)
    with engine(models["f32"]) as e:
        assert e.lone_pads == invariant.LonePads(True, True)
    with engine(models["q8_0"], type_k="q8_0", threads=2) as e:
        assert e.lone_pads == invariant.LonePads(False, False)
    with engine(models["q8_0"]) as e:
        assert e.lone_pads == invariant.LonePads(False, False)
    split_off = llamacpp.split_kv_switch()  # patches/0003: the engine turns the path off
    with engine(models["q8_0"], threads=2) as e:
        assert e.lone_pads == invariant.LonePads(False, not split_off)
        e.lone_pads = invariant.LonePads(False, False)
        alone = logits_of_seq0(e, ticks=8, prompt=DEPTHS["deep"])
        crowd = logits_of_seq0(e, 0, ticks=8, prompt=DEPTHS["deep"])
    same = all(np.array_equal(a, b) for a, b in zip(alone, crowd))
    assert same == split_off  # without the switch, the deep padding row is needed, not decoration
    with engine(models["f32"]) as e:  # and f32's shallow one: tinyBLAS for crowds, vec_dot for a lone column
        e.lone_pads = invariant.LonePads(False, False)
        alone, crowd = logits_of_seq0(e, ticks=8), logits_of_seq0(e, 0, ticks=8)
    assert not all(np.array_equal(a, b) for a, b in zip(alone, crowd))


@pytest.mark.slow
def test_f16_weights_in_amx_buffers_keep_a_rows_bits_alone_and_in_crowds_without_the_dummy_row(models, problems):
    """With at most AMX_MAX_ROWS sequences on an AMX CPU, f16 weights go to AMX buffers, whose kernel gives a
    lone row the bits it has in a crowd: no dummy row. Elsewhere the same harness runs the usual path."""
    holding(problems, "f16", models)
    with engine(models["f16"], n_seq_max=AMX_MAX_ROWS) as e:
        assert e.lone_pads.shallow == (not llamacpp.amx_crashes())
        alone = logits_of_seq0(e)
        crowds = [logits_of_seq0(e, seed) for seed in range(3)]
    for crowd in crowds:
        assert all(np.array_equal(a, b) for a, b in zip(alone, crowd))

@pytest.mark.slow
def test_equal_prompt_chunks_share_one_llama_decode_and_each_keeps_the_bits_it_has_alone(models, problems, monkeypatch):
    """llama.cpp puts chunks of one length on consecutive streams in one ubatch (split_equal): one pass over the
    weights for all of them, and each sequence's logits what it gets alone."""
    holding(problems, "f16", models)
    prompt = lambda s, n: np.array([3 + (s * 37 + k * 11) % 500 for k in range(n)], np.int32)  # noqa: E731
    lengths = [20, 20, 20, 9, 20]
    with engine(models["f16"]) as e:
        alone = {}
        for s, n in enumerate(lengths):
            e.step(Plan([], list(range(8))))
            alone[s] = e.logits_for(Plan([SeqChunk(s, 0, prompt(s, n), draw=0, sampling=GREEDY)]))[s]
        e.step(Plan([], list(range(8))))
        calls, decode = [], e._lc.llama_decode
        monkeypatch.setattr(e._lc, "llama_decode",
                            lambda ctx, batch: calls.append(batch.n_tokens) or decode(ctx, batch))
        together = e.logits_for(Plan([SeqChunk(s, 0, prompt(s, n), draw=0, sampling=GREEDY)
                                      for s, n in enumerate(lengths)]))
    assert sorted(calls) == [9, 80]  # the four 20-token chunks in one call, the 9-token one in another
    assert all(np.array_equal(alone[s], together[s]) for s in alone)

@pytest.mark.slow
def test_without_deterministic_mode_the_same_harness_sees_the_difference(models):
    """The control: one unified pool and the default kernels, where llama.cpp is not batch-invariant."""
    with engine(models["f32"], deterministic=False) as e:
        alone = logits_of_seq0(e)
        crowd = logits_of_seq0(e, 0)
    assert not all(np.array_equal(a, b) for a, b in zip(alone, crowd))


@pytest.mark.slow
def test_the_start_up_check_refuses_a_build_whose_lone_rows_round_differently(models, monkeypatch):
    """Without the padding a lone decode row leaves tinyBLAS: the self-check sees it and the engine refuses
    (f32 weights: f16 ones on an AMX CPU take AMX's kernel, the same for one row as for several)."""
    monkeypatch.setattr(invariant, "pads", lambda rows, n, lone: [])
    with pytest.raises(FatalEngineError, match="deterministic: not on this CPU and model: .* differed") as e:
        engine(models["f32"])
    assert "\n" not in str(e.value) and "--no-deterministic" in str(e.value)


@pytest.mark.slow
def test_left_to_the_engine_the_mode_is_on_where_it_is_free_and_off_with_the_reason_elsewhere(models, tmp_path,
                                                                                           monkeypatch):
    """The default runs the mode where it holds and costs a session decoding alone nothing: q8_0 weights with
    a q8_0 K cache, or on one thread. Where a lone row would need a padding row (an f16 K and V cache past 256
    cells on several threads, f16 or f32 weights everywhere), where the start-up check finds one, and where it
    cannot hold, it is off, saying why."""
    with engine(models["q8_0"], deterministic=None, type_k="q8_0") as e:
        assert e.deterministic == (e.deterministic_problem == "")
        assert e.deterministic or not promised(models["q8_0"]), e.deterministic_problem
        cfg = engine_config(models["q8_0"], kv_layout="streams", deterministic=None, type_k="q8_0")
        assert e.recipe_fingerprint == cfg.recipe(e.deterministic) != cfg.recipe(not e.deterministic)
    with engine(models["q8_0"], deterministic=None) as e:  # one thread: the split-KV path sums as the per-row one
        assert e.deterministic or not promised(models["q8_0"]), e.deterministic_problem
    split_off = llamacpp.split_kv_switch()
    if split_off:  # patches/0003: nothing pays past 256 cells, so q8_0 weights take the mode by default
        with engine(models["q8_0"], deterministic=None, threads=2) as e:
            assert e.deterministic or not promised(models["q8_0"]), e.deterministic_problem
    off = [("f32", "every token (F32 weights")] + ([("q4_k_m", "tiled kernel for a lone row")] if split_off else [
        ("q8_0", "past 256 (flash attention's split-KV path on a f16 K and V cache)"), ("q4_k_m", "past 256")])
    for name, why in off:
        with engine(models[name], deterministic=None, threads=2) as e:
            assert not e.deterministic and e.deterministic_problem.startswith("deterministic: off by default: ")
            assert why in e.deterministic_problem and "\n" not in e.deterministic_problem
    q4_0 = str(make_model(tmp_path / "q4_0.gguf", "tiny-f16", 0, "q4_0"))
    with engine(q4_0, deterministic=None) as e:
        assert not e.deterministic and e.deterministic_problem.startswith("deterministic: not for Q4_0")
    with monkeypatch.context() as m:  # a check that finds a padding row where none was expected
        m.setattr(invariant, "lone_cost", lambda *a: "")
        with engine(models["f32"], deterministic=None) as e:
            assert not e.deterministic and "the start-up check found" in e.deterministic_problem
    monkeypatch.setattr(invariant, "_compare", lambda *a: "a sequence's logits at step 1 differed alone and beside")
    with engine(models["q8_0"], deterministic=None, type_k="q8_0") as e:
        assert not e.deterministic and "differed alone and beside" in e.deterministic_problem


# -- through the scheduler: every rule of engine/invariant.py and costmodel.deterministic_chunk --------
SAMPLINGS = {"greedy": Sampling(logprobs=2), "seeded": Sampling(temperature=0.9, top_k=40, seed=11, logprobs=2)}


@pytest.fixture(scope="module", params=[c[0] for c in CASES])
def chat(request, models, problems):
    """One engine per accepted format, the conversation, and the prompt that continues it."""
    holding(problems, request.param, models)
    with engine(models[request.param]) as e:
        q, answer = history(e)
        yield e, (q, answer), q + answer + [3 + (k * 31) % 500 for k in range(70)]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["greedy", "seeded"])
def test_through_the_scheduler_a_session_is_bitwise_the_same_in_crowds_after_a_restart_and_a_cache_hit(chat, how):
    e, warm, p = chat
    alone = scenario(e, p, SAMPLINGS[how])
    runs = {"crowd 0": scenario(e, p, SAMPLINGS[how], crowd=0), "crowd 1": scenario(e, p, SAMPLINGS[how], crowd=1),
            "restart": scenario(e, p, SAMPLINGS[how], restart_after=17),
            "crowd and restart": scenario(e, p, SAMPLINGS[how], crowd=2, restart_after=5),
            "cache hit": scenario(e, p, SAMPLINGS[how], warm=warm),
            "prompt whole": scenario(e, p, SAMPLINGS[how], room=256),  # alone its 200 tokens go 72, 64, 64
            "cache hit, crowd, restart": scenario(e, p, SAMPLINGS[how], warm=warm, crowd=3, restart_after=30)}
    assert len(alone["tokens"]) == 40 and alone["cached"] == 0
    assert runs["cache hit"]["cached"] == len(warm[0])  # the prompt's cells; the answer's are recomputed
    for what, got in runs.items():
        assert got["tokens"] == alone["tokens"], what
        assert got["logprobs"] == alone["logprobs"], what  # floats compared exactly
    if how == "seeded":
        assert alone["tokens"] != scenario(e, p, SAMPLINGS["greedy"])["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["greedy", "seeded"])
def test_speculative_drafts_right_or_wrong_leave_a_session_bitwise_the_same_alone_in_crowds_and_restarted(
        chat, how, monkeypatch):
    """Speculative decoding (engine/drafts.py): drafts verified as rows of their sequence. Drafts that are
    always right answer the ticks after a drafted one with no llama_decode; drafts that are always wrong
    are dropped with their cells; the lookup's own drafts do either. Whatever the drafts and the mode,
    alone, in a crowd and across a restart, the session's tokens and log-probabilities are the ones it has
    with speculation off."""
    e, _, p = chat
    counts = Counter()
    step = e.step

    def counting(plan):
        res = step(plan)
        counts.update(drafted=res.drafted, served=res.served, kept=sum(map(len, e.drafts.ahead.values())))
        return res

    monkeypatch.setattr(e, "step", counting)
    monkeypatch.setattr(e.drafts, "mode", "off")
    off = scenario(e, p, SAMPLINGS[how])
    assert counts["drafted"] == 0
    full = p + off["tokens"]
    wrong = lambda t: 3 + (t - 2) % (e.n_vocab - 3)  # noqa: E731
    drafts = {"right": lambda seq, toks, k: full[len(toks):len(toks) + k],
              "wrong": lambda seq, toks, k: [wrong(t) for t in full[len(toks):len(toks) + k]], "lookup": None}
    # lookup drafts as many as allowed whatever came before: right and wrong drafts at full length; auto as
    # the cost model decides, with the lookup's own drafts and with right ones
    for name, mode in (("right", "lookup"), ("wrong", "lookup"), ("lookup", "auto"), ("right", "auto")):
        propose = drafts[name]
        with monkeypatch.context() as m:
            m.setattr(e.drafts, "mode", mode)
            free_rows = RowCost([(1, 10.0), (64, 14.0)])  # rows nearly free (a GPU's): right drafts pay
            m.setattr(free_rows, "observe", lambda *a, **k: None)  # whatever this CPU's ticks take
            m.setattr(e.drafts, "row_cost", free_rows)
            if propose:
                m.setattr(e.drafts.lookup, "propose", propose)
            counts.clear()
            runs = {"alone": scenario(e, p, SAMPLINGS[how])}
            alone_counts = counts.copy()  # "wrong" is wrong for x only: a neighbour's may be right by chance
            runs["crowd and restart"] = scenario(e, p, SAMPLINGS[how], crowd=2, restart_after=5)
        for what, got in runs.items():
            assert got["tokens"] == off["tokens"] and got["logprobs"] == off["logprobs"], (name, mode, what)
        if name == "right" and mode == "lookup":  # 39 decode ticks each way: most answered from drafts
            assert counts["served"] >= 40 and counts["drafted"] >= counts["served"], counts
        elif name == "wrong":  # nothing kept: each draft was checked against the sampler's own choice
            assert alone_counts["served"] == alone_counts["kept"] == 0 and alone_counts["drafted"] >= 38, (
                mode, alone_counts)
        elif name == "right":  # auto: the lookup's guesses turn out right, and it drafts on
            assert counts["served"] >= 20, (mode, counts)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["greedy", "seeded"])
def test_a_draft_models_drafts_leave_a_session_bitwise_the_same(models, problems, how):
    """A q8_0 copy drafting for the f32 model (llama-server's -md): its guesses are checked like any draft,
    so the session is the one it is with speculation off, alone and in a crowd across a restart."""
    holding(problems, "f32", models)
    cfg = engine_config(models["f32"], n_seq_max=8, ctx=4096, n_batch=512, threads=1, kv_layout="streams",
                       deterministic=True, draft_model=models["q8_0"], spec="draft", draft_max=4)
    with LlamaEngine(cfg) as e:
        q, answer = history(e)
        p = q + answer
        served = Counter()
        step = e.step
        e.step = lambda plan: (r := step(plan), served.update(n=r.served, drafted=r.drafted))[0]
        e.drafts.mode = "off"
        off = scenario(e, p, SAMPLINGS[how])
        assert served["drafted"] == 0
        e.drafts.mode = "draft"
        for got in (scenario(e, p, SAMPLINGS[how]), scenario(e, p, SAMPLINGS[how], crowd=2, restart_after=5)):
            assert got["tokens"] == off["tokens"] and got["logprobs"] == off["logprobs"]
    assert served["n"] >= 10 and served["drafted"] >= 4 * 39, served  # a q8_0 copy guesses the f32 model well


def test_a_draft_model_with_another_vocab_is_refused_in_one_line(models, tmp_path):
    other = str(make_model(tmp_path / "bpe.gguf", "tiny-bpe", 0))
    with pytest.raises(FatalEngineError, match="cannot draft for this model: token 0 is .* there, '<unk>' here"):
        LlamaEngine(engine_config(models["f32"], n_seq_max=2, ctx=512, kv_layout="streams", draft_model=other))
    with pytest.raises(ValueError, match="spec: draft needs a draft model"):
        engine_config(models["f32"], kv_layout="streams", spec="draft").validate()


@pytest.mark.slow
def test_without_deterministic_mode_speculation_keeps_the_sampler_and_its_draws(models, monkeypatch):
    """Off deterministic mode a drafted chunk's rows may differ in their last bits from one-at-a-time decoding
    (llama.cpp's kernels), so a seeded session may part where a draw lands within rounding of a boundary; the
    sampler and its draws are the same, and so the distribution: with right drafts most seeded sessions
    begin as they do with speculation off (at temperature 1 over a random model's broad distribution, about
    one in thirty tokens part on the bits: f16 flash attention), where a draw taken out of turn would part
    nearly all of them at their first token answered from a draft."""
    cfg = engine_config(models["f32"], n_seq_max=8, ctx=4096, n_batch=512, threads=1, kv_layout="streams")
    p = [3 + (k * 13) % 500 for k in range(40)]
    same = served = 0
    with LlamaEngine(cfg) as e:
        assert not e.deterministic and e.drafts.mode == "auto"
        for seed in range(24):
            sampling = Sampling(temperature=1.0, seed=seed)
            e.drafts.mode = "off"
            off = scenario(e, p, sampling, n_new=24)
            full = p + off["tokens"]
            e.drafts.mode = "lookup"
            monkeypatch.setattr(e.drafts.lookup, "propose", lambda seq, toks, k: full[len(toks):len(toks) + k])
            step = e.step
            got = []
            monkeypatch.setattr(e, "step", lambda plan: got.append(step(plan)) or got[-1])
            on = scenario(e, p, sampling, n_new=24)
            monkeypatch.undo()
            same += on["tokens"][:8] == off["tokens"][:8]
            served += sum(r.served for r in got)
    assert same >= 16 and served >= 24 * 12, (same, served)


@pytest.mark.slow
def test_through_a_node_a_lone_session_with_right_drafts_gets_every_other_token_from_the_tick_before(tmp_path):
    """A model whose logits are all equal answers every greedy row with one token, so every draft is right:
    through the front's pipelined ticks (their follow-ups filled in by the engine), each drafted tick is
    followed by one the engine answers from it. Seeded sampling over equal logits draws at random, so
    its drafts are nearly all wrong, and dropped."""
    flat = str(make_model(tmp_path / "flat.gguf", "tiny", 0, flat=True))
    prompt = [3 + k for k in range(20)]
    with NodeProcess(flat, "--deterministic") as n, n.client(timeout_s=120) as c:
        greedy = c.generate("greedy", tokens=prompt, max_tokens=101, ignore_eos=True)
        after_greedy = dict(c.status()["telemetry"]["engine"])
        seeded = c.generate("seeded", tokens=prompt, max_tokens=101, ignore_eos=True,
                            sampling=Sampling(temperature=1.0, seed=3))
        after_seeded = c.status()["telemetry"]["engine"]
    assert len(greedy.tokens) == 101 and len(set(greedy.tokens)) == 1 and greedy.done["reason"] == R.LENGTH
    # 100 decode ticks' tokens: about half computed with a draft, the other half answered from it
    assert after_greedy["drafts_served_total"] >= 45 and after_greedy["drafted_rows_total"] >= 45, after_greedy
    assert len(seeded.tokens) == 101 and len(set(seeded.tokens)) > 50 and seeded.done["reason"] == R.LENGTH
    drafted = after_seeded["drafted_rows_total"] - after_greedy["drafted_rows_total"]
    served = after_seeded["drafts_served_total"] - after_greedy["drafts_served_total"]
    assert drafted >= 95 and served <= 5, (drafted, served)


JOB = dict(tokens=[3 + (k * 11) % 500 for k in range(150)], max_tokens=500, ignore_eos=True, logprobs=2,
           sampling=Sampling(temperature=0.9, top_k=40, seed=5))


def same(got, want) -> None:
    """Bitwise the same session: tokens, their log-probabilities (floats compared exactly) and text."""
    assert got.tokens == want.tokens and got.done["text"] == want.done["text"]
    assert logprob_entries(got) == logprob_entries(want)


@pytest.mark.slow
@pytest.mark.parametrize("name, kv", [("f16", ("f16", "f16")), ("q8_0", ("f16", "f16")), ("q4_k_m", ("f16", "f16")),
                                      ("f16", ("q8_0", "q4_0"))])
def test_through_a_node_alone_in_a_crowd_after_a_kill_and_on_a_cache_hit_a_session_is_the_same(models, problems,
                                                                                              name, kv):
    """Quantized KV (llama-server's --cache-type-k/-v) too: the start-up self-check runs on the context
    as configured, so the mode is on only where it holds, and the budget counts llama.cpp's own bytes."""
    holding(problems, name, models)
    with NodeProcess(models[name], "--deterministic", "--ctx", "8192", "-ctk", kv[0], "--cache-type-v", kv[1]) as n, \
            n.client(timeout_s=300) as c:
        info = c.status()["node"]
        assert info["deterministic"] is True and info["kv_layout"] == "streams"
        assert (info["cache_type_k"], info["cache_type_v"]) == kv
        llama_kv = sum(d["kv_bytes"] for d in info["devices"])  # from llama.cpp's load log, in 0.01 MiB
        assert abs(info["budgets"]["kv_budget_bytes"] - llama_kv) <= 0.01 * llama_kv
        alone = c.generate("alone", **JOB)
        rng = random.Random(5)
        for i in range(7):  # others arrive before, with and after it, with jitter
            c.submit(f"other{i}", tokens=[3 + rng.randrange(500) for _ in range(rng.choice([1, 9, 60, 64, 200]))],
                     max_tokens=rng.choice([40, 200, 500]), ignore_eos=True)
            if i == 3:
                c.submit("crowded", **JOB)
            time.sleep(rng.random() * 0.05)
        crowded = c.collect(["crowded"] + [f"other{i}" for i in range(7)])["crowded"]
        hit = c.generate("hit", **JOB)  # the earlier runs' prompt cells are in the cache
        c.submit("killed", **JOB)
        kept, seen = [], 0
        while seen < 100:  # the engine dies a fifth of the way in
            kept.append(c.recv(60))
            seen += len(kept[-1]["tokens"]) if kept[-1]["event"] == "tokens" and kept[-1]["id"] == "killed" else 0
        os.kill(c.status()["node"]["engine_pid"], signal.SIGKILL)
        c.buffer.extendleft(reversed(kept))
        killed = c.collect(["killed"])["killed"]
        engine_stats = c.status()["telemetry"]["engine"]
    assert len(alone.tokens) == 500 and alone.done["usage"]["cached_tokens"] == 0
    assert hit.done["usage"]["cached_tokens"] == 150 - 64  # a tile of the prompt is left to compute
    for got in (crowded, hit, killed):
        same(got, alone)
    assert killed.done["reason"] == R.LENGTH and engine_stats["restarts"] == 1
    assert engine_stats["drafted_rows_total"] > 0  # "alone" decoded with drafts beside its rows


@pytest.mark.slow
def test_a_node_asked_for_what_no_test_proves_refuses_to_start_in_one_line_and_by_default_says_why_it_is_off(tmp_path):
    q4_0 = str(make_model(tmp_path / "q4_0.gguf", "tiny-f16", 0, "q4_0"))
    out = serve(q4_0, "--deterministic", "--listen", f"ipc://{tmp_path}/n.sock", "--telemetry", f"ipc://{tmp_path}/t.sock")
    lines = [ln for ln in out.stderr.splitlines() if "deterministic: not" in ln]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "Q4_0" in lines[0] and "q4_k_m" in lines[0]
    with NodeProcess(q4_0) as n, n.client() as c:
        assert c.status()["node"]["deterministic"] is False and c.generate("x", tokens=[3, 4], max_tokens=3).done
    said = [ln for ln in n.log().splitlines() if "deterministic=off (deterministic: not for Q4_0" in ln]
    assert len(said) == 1 and "meshnode ready:" in said[0]
