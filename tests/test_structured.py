"""Structured output (response_format, issue 27): on the random-weights demo models at temperature 1,
every constrained answer parses and validates; the constraint holds through the real scheduler and
engine, on both vocabulary families (byte-level SPM and GPT-2 BPE)."""
import json

import jsonschema
import pytest

from helpers import scheduler
from meshnode.core.session import Session
from meshnode.core.types import ResponseFormat, Sampling
from meshnode.dev.drive import run_to_completion
from meshnode.engine.llama import EngineConfig, LlamaEngine
from meshnode.text.constraints import Constraints
from meshnode.text.tokenizer import Tokenizer

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


@pytest.fixture(scope="module", params=["tiny", "tiny-bpe"])
def served(request, tmp_path_factory):
    """(engine, tokenizer, constraints) for one demo vocabulary."""
    from meshnode.ops.models import make_model

    path = str(make_model(tmp_path_factory.mktemp("m") / f"{request.param}.gguf", request.param, 0))
    tok = Tokenizer(path)
    with LlamaEngine(EngineConfig(path, n_seq_max=8, n_ctx=8 * 1024, n_threads=1, kv_layout="streams")) as e:
        yield e, tok, Constraints(tok.vocab)
    tok.close()


def generate(served, fmt: ResponseFormat | None, seeds, max_tokens=200, prompt=(5, 9, 33, 77)) -> dict:
    """Seeded sessions at temperature 1 through the scheduler and the engine: {seed: (text, reason)}."""
    engine, tok, constraints = served
    grammar = None
    if fmt is not None:
        grammar, why = constraints.compile(fmt)
        assert grammar, why
    _, sched = scheduler(engine, max_queue=len(list(seeds)))
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
