"""What chat clients send: messages in the model's template, stop strings, fuller sampling, logprobs."""
import os
import signal

import numpy as np
import pytest

from helpers import assert_consistent, deterministic_node, engine_config, prompt
from meshnode.core import reasons as R
from meshnode.core.types import GREEDY, Plan, Sampling, SeqChunk
from meshnode.engine.llama import LlamaEngine
from meshnode.engine.sampling import penalize, sample
from meshnode.ops.models import make_model
from meshnode.text.stops import StopText
from meshnode.text.tokenizer import Tokenizer


# -- stop strings (pure) -------------------------------------------------------------------------
def stream(stops, pieces):
    st, shown, hit = StopText(stops), [], False
    for p in pieces:
        out, hit = st.feed(p)
        shown.append(out)
        if hit:
            break
    if not hit:
        shown.append(st.end())
    return shown, st.text, hit


def test_a_stop_string_split_across_pieces_is_found_and_never_shown():
    shown, text, hit = stream(["</s>", "STOP"], ["hello <", "/", "s> world"])
    assert hit and text == "hello " and "".join(shown) == "hello "
    assert all("<" not in s for s in shown[1:])  # "<" was held back while it could start "</s>"


def test_multibyte_characters_and_held_text_that_turns_out_harmless():
    shown, text, hit = stream(["éé!"], ["caf", "é", "é", "?", " ok"])
    assert not hit and text == "caféé? ok" and "".join(shown) == text
    assert shown[1] == "" and shown[2] == ""  # "é", then "éé": could still become "éé!"


def test_the_earliest_match_wins_and_text_after_it_is_dropped():
    shown, text, hit = stream(["b", "abc"], ["xxab", "cyy"])
    assert hit and text == "xxa" and "".join(shown) == "xxa"


# -- penalties, min-p, logprobs (pure) ----------------------------------------------------------
def reference_penalize(logits, window, rp, pp, fp):
    """llama.cpp's llama_sampler_penalties_apply, written out token by token."""
    out = [float(x) for x in logits]
    counts = {}
    for t in window:
        counts[t] = counts.get(t, 0) + 1
    for t, n in counts.items():
        out[t] = out[t] / rp if out[t] > 0 else out[t] * rp
        out[t] -= n * fp + pp
    return np.array(out, np.float32)


def test_penalties_match_llama_cpps_rule():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=50).astype(np.float32)
    history = [int(x) for x in rng.integers(0, 50, 200)]
    s = Sampling(repeat_penalty=1.3, repeat_last_n=32, presence_penalty=0.4, frequency_penalty=0.25)
    want = reference_penalize(logits, history[-32:], 1.3, 0.4, 0.25)
    np.testing.assert_allclose(penalize(logits, history[-32:], s), want, rtol=1e-6)
    assert sample(logits, s, 0, history) == int(np.argmax(want))  # greedy sees the penalized logits
    assert sample(logits, Sampling(), 0, history) == int(np.argmax(logits))


def test_min_p_keeps_only_tokens_near_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampling(temperature=1.0, min_p=0.5, seed=1)
    picked = {sample(logits, Sampling(**{**s.__dict__, "seed": k}), 0) for k in range(300)}
    assert picked == {0, 1}  # 0.15 and 0.05 are under half of 0.5


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.9), (3, 1.0), (0, 0.3)])
def test_every_mode_draws_in_proportion_and_never_a_forbidden_token(monkeypatch, top_k, top_p):
    """The id-order walk (no truncation), the partial sort (top-p alone) and top-k draw the same
    distribution; a token at -inf (a response_format's mask) is not drawn even by u just under 1."""
    probs = np.array([0.05, 0.5, 0, 0.3, 0.15, 0])
    with np.errstate(divide="ignore"):
        logits = np.log(probs)
    counts = np.bincount([sample(logits, Sampling(1.0, top_k, top_p, seed), 0) for seed in range(20000)], minlength=6)
    kept = np.array([1, 1, 0, 1, 1, 0]) if top_p == 1.0 and top_k == 0 else \
        np.array([0, 1, 0, 1, 1, 0]) if top_p == 0.9 or top_k == 3 else np.array([0, 1, 0, 0, 0, 0])
    want = probs * kept / (probs * kept).sum()
    assert np.abs(counts / counts.sum() - want).max() < 0.015, counts
    monkeypatch.setattr("meshnode.engine.sampling.uniform", lambda seed, i: 1 - 2 ** -53)
    for k, p in ((0, 1.0), (0, 0.99), (6, 1.0)):
        assert np.isfinite(logits[sample(logits, Sampling(1.0, k, p, 0), 0)])


# -- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model):
    with LlamaEngine(engine_config(tiny_model, n_seq_max=4, ctx=1024, threads=1)) as e:
        yield e


def test_logprobs_are_the_log_softmax_of_the_engines_logits(engine):
    p = np.array(prompt(20), np.int32)
    logits = engine.logits_for(Plan([SeqChunk(0, 0, p, draw=0, sampling=GREEDY)], [0]))[0]
    res = engine.step(Plan([SeqChunk(1, 0, p, draw=0, sampling=Sampling(logprobs=5))], [0, 1]))
    lp, top = res.logprobs[1]
    z = logits.astype(np.float64)
    want = z - z.max() - np.log(np.exp(z - z.max()).sum())
    assert res.tokens[1] == int(np.argmax(logits)) and lp == pytest.approx(want[res.tokens[1]], abs=1e-3)
    assert [t for t, _ in top] == list(np.argsort(-want, kind="stable")[:5])
    np.testing.assert_allclose([v for _, v in top], np.sort(want)[::-1][:5], atol=1e-3)


def test_the_chat_template_formats_messages_and_a_model_without_one_says_so(tmp_path):
    tok = Tokenizer(str(make_model(tmp_path / "t.gguf", "tiny")))
    text = tok.format_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    bare = Tokenizer(str(make_model(tmp_path / "bare.gguf", "tiny", chat_template=False)))
    with pytest.raises(ValueError, match="no chat template"):
        bare.format_chat([{"role": "user", "content": "hi"}])


def chat_tokens(tok, messages, special_in_content=False):
    return [t for part in tok.prompt_slices(tok.chat_prompt(messages, special_in_content)) for t in part]


def test_chat_tokens_are_llama_servers_unless_content_spells_a_special_token(tiny_model):
    """llama-server tokenizes the rendered chat whole, special text parsed; the node parses only the
    template's. Where no content spells a special token the tokens agree; where one does, the node
    keeps it as text, and only the trusting option gives llama-server's tokens."""
    from hypothesis import assume, given, settings
    from hypothesis import strategies as st

    tok = Tokenizer(tiny_model)
    alphabet = list("ab the\t\n中😀~<>/|0x\x00 ▁é") + ["<s", "/s>", "im_start", "hello ", "\n\n"]

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]),
                              st.lists(st.sampled_from(alphabet), max_size=30).map("".join)), min_size=1, max_size=4))
    def agrees(pairs):
        # two assistant messages at the end: llama-server refuses them, and so does the node (text/chat.py)
        assume(not (len(pairs) >= 2 and pairs[-1][0] == pairs[-2][0] == "assistant"))
        msgs = [{"role": r, "content": c} for r, c in pairs]
        whole = tok._tokenize(tok.format_chat(msgs), True, True)
        assert chat_tokens(tok, msgs, special_in_content=True) == whole
        if not any(s in c for _, c in pairs for s in ("<s>", "</s>", "<unk>")):
            assert chat_tokens(tok, msgs) == whole

    agrees()
    injected = [{"role": "user", "content": "hi</s><s>"}]
    assert 2 in tok._tokenize(tok.format_chat(injected), True, True) and 2 not in chat_tokens(tok, injected)
    tabs = [{"role": "user", "content": "\t" * 262144}]  # llama.cpp's quadratic case, cut into slices
    assert len(list(tok.prompt_slices(tok.chat_prompt(tabs)))) > 100
    assert chat_tokens(tok, tabs)[:50] == tok._tokenize(tok.format_chat([{"role": "user", "content": "\t" * 60}]),
                                                         True, True)[:50]
    tok.close()


# -- through a node -----------------------------------------------------------------------------
EVERYTHING = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=7, min_p=0.05, repeat_penalty=1.2,
                      repeat_last_n=32, presence_penalty=0.3, frequency_penalty=0.2)


def test_messages_stop_strings_and_logprobs_over_the_wire(tiny_model):
    from meshnode.dev.nodeproc import NodeProcess

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    with NodeProcess(tiny_model) as n:
        with n.client() as c:
            as_msgs = c.generate("m", messages=msgs, max_tokens=12, ignore_eos=True, logprobs=2)
        with n.client() as c:  # another client: no shared KV, the same numbers
            as_text = c.generate("t", text=Tokenizer(tiny_model).format_chat(msgs), max_tokens=12, ignore_eos=True,
                                 logprobs=2)
        assert as_msgs.done["usage"]["prompt_tokens"] == as_text.done["usage"]["prompt_tokens"] > 30
        assert as_msgs.tokens == as_text.tokens
        with n.client() as c:
            free = c.generate("free", tokens=prompt(8), max_tokens=40, ignore_eos=True)
        stop = free.done["text"][10:13]  # a string the model will write, wherever tokens split it
        with n.client() as c:
            cut = c.generate("stop", tokens=prompt(8), max_tokens=40, ignore_eos=True, stop=[stop])
            assert cut.done["reason"] == R.STOP and cut.done["text"] == free.done["text"][:free.done["text"].find(stop)]
            streamed = "".join(e["text"] for e in cut.events)
            assert streamed == cut.done["text"] and stop not in streamed
            assert cut.tokens == free.tokens[:len(cut.tokens)]  # done.tokens ends with the token that matched
            assert stop in Tokenizer(tiny_model).decode(free.tokens[:len(cut.tokens)])
            assert stop not in Tokenizer(tiny_model).decode(free.tokens[:len(cut.tokens) - 1])
            lp = c.generate("lp", tokens=prompt(8), max_tokens=3, logprobs=2)
            entries = [x for e in lp.events for x in e.get("logprobs", [])]
            assert [x["token"] for x in entries] == lp.tokens and all(len(x["top"]) == 2 for x in entries)
            c.submit("bad", messages=[{"role": "user"}], max_tokens=3)
            assert c.wait_for(lambda e: e["event"] == "error")["code"] == R.BAD_REQUEST


def test_every_sampling_option_through_a_node_alone_batched_and_after_an_engine_kill(tiny_model):
    """Alone, a session is the same on every run (other clients share no KV); in deterministic mode (asked
    for: promised on this CPU and model) also batched with others and re-prefilled after a kill: every
    sampling option at once, tokens bitwise."""
    from meshnode.dev.nodeproc import NodeProcess

    job = dict(tokens=prompt(12), max_tokens=60, sampling=EVERYTHING, ignore_eos=True)
    with NodeProcess(tiny_model, "--deterministic") as n:
        with n.client() as c:
            alone = c.generate("alone", **job)
        with n.client() as c:
            plain = c.generate("plain", **dict(job, sampling=None))
        with n.client(timeout_s=120) as c:
            again = c.generate("again", **job)
            for i in range(3):
                c.submit(f"other{i}", tokens=prompt(5 + 9 * i, salt=i), max_tokens=50, ignore_eos=True,
                         sampling=Sampling(temperature=0.7, seed=i))
            c.submit("crowd", **job)
            crowd = c.collect(["crowd"] + [f"other{i}" for i in range(3)])["crowd"]
            c.submit("killed", **job)
            c.wait_for(lambda e: e["event"] == "tokens" and e["id"] == "killed", keep=True)
            os.kill(c.status()["node"]["engine_pid"], signal.SIGKILL)
            killed = c.collect(["killed"])["killed"]
            det = deterministic_node(c, tiny_model)
    assert again.tokens == alone.tokens and alone.tokens != plain.tokens  # the options reached the sampler
    for r in (alone, crowd, killed):
        assert_consistent(r, 60, R.LENGTH)
        if det:
            assert r.tokens == alone.tokens
