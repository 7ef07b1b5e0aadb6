"""Structured output (response_format, issue 27): on the random-weights demo models at temperature 1,
every constrained answer parses and validates; the constraint holds through the real scheduler and
engine, on both vocabulary families (byte-level SPM and GPT-2 BPE)."""
import json

import jsonschema
import pytest

from helpers import engine_config, history, logprob_entries, promised, scenario, scheduler
from ipc import link
from meshnode.core import reasons as R
from meshnode.core.session import Session
from meshnode.core.types import ResponseFormat, Sampling
from meshnode.dev.drive import run_to_completion
from meshnode.dev.nodeproc import NodeProcess
from meshnode.engine.llama import LlamaEngine
from meshnode.text.constraints import Constraints
from meshnode.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # nodes and llama.cpp engines (the real model, the tiny ones)

SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "nested arrays": {"type": "object", "properties": {"grid": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "boolean"}}}},
                      "required": ["grid"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5},
                                                 "ok": {"type": "boolean"}},
                "required": ["x", "ok"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
}
SEEDS = range(20)
# long enough that a restart lands in the middle of it (each item is ~20 tokens of bytes or word pieces)
ROWS = {"type": "array", "minItems": 6, "maxItems": 6,
        "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                   "n": {"type": "integer", "minimum": 0, "maximum": 999}},
                  "required": ["name", "n"], "additionalProperties": False}}


@pytest.fixture(scope="module", params=["tiny", "tiny-bpe"])
def served(request, tmp_path_factory):
    """(engine, tokenizer, constraints) for one demo vocabulary."""
    from meshnode.ops.models import make_model

    path = str(make_model(tmp_path_factory.mktemp("m") / f"{request.param}.gguf", request.param, 0))
    tok = Tokenizer(path)
    with LlamaEngine(engine_config(path, n_seq_max=8, ctx=8 * 1024, threads=1, kv_layout="streams",
                                  deterministic=True if promised(path) else None)) as e:
        yield e, tok, Constraints(tok.vocab, link.MAX_GRAMMAR_BYTES)
    tok.close()


def generate(served, fmt: ResponseFormat | None, seeds, max_tokens=200, prompt=(5, 9, 33, 77)) -> dict:
    """Seeded sessions at temperature 1 through the scheduler and the engine: {seed: (text, reason)}."""
    engine, tok, constraints = served
    grammar = None
    if fmt is not None:
        grammar, why = constraints.compile(fmt)
        assert grammar, why
    # the module's engine outlives this scheduler: no prefix cache may leave KV the next one does not know
    _, sched = scheduler(engine, max_queue=len(list(seeds)), prefix_cache="off")
    for s in seeds:
        assert sched.submit(Session(s, [p + s % 7 for p in prompt], max_tokens, Sampling(1.0, 0, 1.0, s),
                                    grammar=grammar)).accepted
    done = {e.session.key: e for e in run_to_completion(sched, engine) if e.kind == "done"}
    return {s: (tok.decode(ev.session.generated), ev.reason) for s, ev in done.items()}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_seed_answers_valid_json_for_the_schema(served, name):
    schema = SCHEMAS[name]
    for seed, (text, reason) in generate(served, ResponseFormat("json_schema", json.dumps(schema)), SEEDS).items():
        assert reason == "EOS", (seed, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_grammar_constrain_too(served):
    for seed, (text, _) in generate(served, ResponseFormat("regex", "[a-z]{2,6}-[0-9]{1,3}"), SEEDS).items():
        assert __import__("re").fullmatch("[a-z]{2,6}-[0-9]{1,3}", text), (seed, text)
    gbnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    for seed, (text, _) in generate(served, ResponseFormat("grammar", gbnf), SEEDS).items():
        assert text in ("yes", "no") or (text.startswith("maybe ") and text[-1].isdigit()), (seed, text)


def test_an_unconstrained_control_is_not_json(served):
    """The constraint is what makes the answers parse: the same sessions without it do not."""
    bad = 0
    for text, _ in generate(served, None, SEEDS, max_tokens=40).values():
        try:
            json.loads(text)
        except ValueError:
            bad += 1
    assert bad == len(SEEDS)


def test_a_bad_schema_or_regex_is_refused_with_the_librarys_words(served):
    _, _, constraints = served
    for fmt, words in ((ResponseFormat("json_schema", '{"type": "objekt"}'), "objekt"),
                       (ResponseFormat("regex", "[a-"), "regex")):
        grammar, why = constraints.compile(fmt)
        assert not grammar and words in why


def test_a_constrained_session_is_the_same_alone_in_a_crowd_after_a_restart_and_on_a_cache_hit(served):
    """Deterministic mode: the matcher is rebuilt by replay after the KV is lost, follows a prefix-cache
    hit, and masks only its own row, so x's tokens are the same every way and its neighbours' tokens are
    those they get beside an unconstrained x."""
    e, tok, constraints = served
    if not e.deterministic:
        assert not promised(e.cfg.model_path), f"deterministic mode is promised here: {e.deterministic_problem}"
        pytest.skip(f"deterministic mode does not hold here: {e.deterministic_problem}")
    grammar, why = constraints.compile(ResponseFormat("json_schema", json.dumps(ROWS)))
    assert grammar, why
    q, answer = history(e)
    p = q + answer + [3 + (k * 31) % 500 for k in range(20)]
    seeded = Sampling(1.0, 0, 1.0, 3, logprobs=2)
    alone = scenario(e, p, seeded, n_new=400, grammar=grammar)
    runs = {"crowd": scenario(e, p, seeded, n_new=400, crowd=1, grammar=grammar),
            "restart": scenario(e, p, seeded, n_new=400, restart_after=17, grammar=grammar),
            "cache hit": scenario(e, p, seeded, n_new=400, warm=(q, answer), grammar=grammar),
            "cache hit, crowd, restart": scenario(e, p, seeded, n_new=400, warm=(q, answer), crowd=2, restart_after=40,
                                                  grammar=grammar)}
    jsonschema.validate(json.loads(tok.decode(alone["tokens"])), ROWS)
    assert 40 < len(alone["tokens"]) < 400 and alone["tokens"][-1] in e.eog
    assert runs["cache hit"]["cached"] > 0
    for what, got in runs.items():
        assert got["tokens"] == alone["tokens"], what
        assert got["logprobs"] == alone["logprobs"], what
    free = scenario(e, p, seeded, n_new=len(alone["tokens"]), crowd=1)
    assert free["others"] == runs["crowd"]["others"] and free["tokens"] != alone["tokens"]


def test_through_a_node_constraints_hold_across_an_engine_kill_and_end_as_they_should(tmp_path):
    """Over the engine link (a grammar sent once, named by key), through a kill at tick 12 and its
    re-prefill: every constrained answer validates; a stop string or max_tokens cut ends it with
    `incomplete`; a pattern the library rejects is a counted BAD_REQUEST, before admission."""
    from meshnode.ops.models import make_model

    path = str(make_model(tmp_path / "bpe.gguf", "tiny-bpe", 0))
    rows = ResponseFormat("json_schema", json.dumps(ROWS))
    code = ResponseFormat("regex", "[A-Z]{2}-[0-9]{3}")
    with NodeProcess(path, internal={"faults": [{"kind": "kill", "at_tick": 12}, {}]}) as n, n.client() as c:
        for i in range(6):
            c.submit(f"rows{i}", text="list them:", max_tokens=400, sampling=Sampling(1.0, 0, 1.0, i), response_format=rows)
        for i in range(2):
            c.submit(f"code{i}", tokens=[5, 9, 33], max_tokens=20, sampling=Sampling(1.0, 0, 1.0, i), response_format=code)
        c.submit("cut", tokens=[5, 9], max_tokens=3, response_format=rows)
        c.submit("stopped", tokens=[5, 9], max_tokens=400, response_format=rows, stop=['"n"'])
        got = c.collect([f"rows{i}" for i in range(6)] + ["code0", "code1", "cut", "stopped"], timeout_s=300)
        before = c.status()["telemetry"]["bad_frames_total"]
        c.submit("bad", tokens=[5], response_format=ResponseFormat("regex", "[A-"))
        bad = c.collect(["bad"])["bad"]
        t = c.status()["telemetry"]
    assert t["engine"]["restarts"] == 1
    for i in range(6):
        r = got[f"rows{i}"]
        assert r.done["reason"] == R.EOS and "incomplete" not in r.done, r.done
        jsonschema.validate(json.loads(r.done["text"]), ROWS)
    for i in range(2):
        assert __import__("re").fullmatch("[A-Z]{2}-[0-9]{3}", got[f"code{i}"].done["text"]), got[f"code{i}"].done
    assert got["cut"].done["reason"] == R.LENGTH and got["cut"].done["incomplete"] is True
    assert got["stopped"].done["reason"] == R.STOP and got["stopped"].done["incomplete"] is True
    assert bad.done is None and bad.admission["event"] == "error" and bad.admission["code"] == R.BAD_REQUEST
    assert "regex" in bad.admission["detail"] and t["bad_frames_total"] == before + 1


# grammars the library compiles and then gives up on while generating (its limits: items in a row, rows)
FAILING = (ResponseFormat("grammar", 'root ::= "a" root'),
           ResponseFormat("grammar", "root ::= " + " | ".join(f'"w{i}"' for i in range(2001))))


def test_grammars_that_fail_while_generating_end_their_own_sessions_and_nobody_elses(tiny_model):
    """20 sessions whose grammars the library stops on after a token or two, sent while six unconstrained
    sessions decode: each ends `done BAD_REQUEST` naming the library's limit, with `incomplete`, and the six
    get every token, bitwise what they get alone (deterministic mode: the failed rows shared their ticks).
    Before: the failure refused the whole tick and every session in it ended ENGINE_ERROR."""
    crowd = {f"c{i}": dict(tokens=[3 + i, 40, 41, 42], max_tokens=60, ignore_eos=True, logprobs=2,
                           sampling=Sampling(1.0, 0, 1.0, i)) for i in range(6)}
    with NodeProcess(tiny_model, "--deterministic") as n, n.client() as c:
        alone = {sid: c.generate(sid, **kw) for sid, kw in crowd.items()}
        for sid, kw in crowd.items():
            c.submit(sid, **kw)
        for i in range(20):  # one each time the crowd streams a token, so failures land all through its decode
            c.wait_for(lambda e: e["event"] == "tokens" and e["id"] in crowd, keep=True)
            c.submit(f"g{i}", tokens=[5, 9, 33], max_tokens=100, sampling=Sampling(1.0, 0, 1.0, i),
                     response_format=FAILING[i % 2])
        got = c.collect([*crowd, *(f"g{i}" for i in range(20))], timeout_s=300)
        t = c.status()["telemetry"]
    for sid in crowd:
        assert got[sid].done["reason"] == R.LENGTH, got[sid].done
        assert got[sid].tokens == alone[sid].tokens and logprob_entries(got[sid]) == logprob_entries(alone[sid])
    for i in range(20):
        d = got[f"g{i}"].done
        assert d["reason"] == R.BAD_REQUEST and d["incomplete"] is True, d
        assert ("Too many items" if i % 2 == 0 else "max is 2000") in d["detail"] and "<state>" not in d["detail"]
    assert t["engine"]["restarts"] == 0 and t["healthy"] and t["constraint_failures_total"] == 20


def test_a_constraint_no_text_can_match_is_refused_before_admission(served):
    """A regex that matches nothing, a schema that is only a reference to itself: llguidance compiles both,
    then allows no first token. Refused at compile time with why, never an `EOS` with "" claiming success."""
    _, _, constraints = served
    for fmt in (ResponseFormat("regex", r"[^\s\S]"),
                ResponseFormat("json_schema",
                               json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}))):
        grammar, why = constraints.compile(fmt)
        assert grammar is None and "no output can ever match it" in why and "<state>" not in why, why
