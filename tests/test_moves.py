"""Sessions that move between nodes: `export` on one, `import` of its state on another with the same recipe,
and the client's stream goes on there with the next token, none lost or repeated (docs/protocol.md)."""
import pytest

from ipc import protocol as P
from meshnode.core import reasons as R
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess

# deterministic on both (the f32 tiny model's mode is bitwise across batch shapes and re-prefills); a tick
# takes at least 30 ms and one token, so a session of 300 is still running when the export comes
SLOW = {"faults": [{"step_sleep_s": 0.03}]}
ARGS = ("--deterministic", "--decode-steps-ms", "0")
PROMPT = [3 + (k * 29) % 500 for k in range(37)]
ASK = dict(tokens=PROMPT, max_tokens=300, ignore_eos=True, sampling=Sampling(0.9, 40, 0.95, 11), logprobs=1)


@pytest.fixture(scope="module")
def nodes(tiny_model):
    with NodeProcess(tiny_model, *ARGS, internal=SLOW) as a, NodeProcess(tiny_model, *ARGS, internal=SLOW) as b, \
            a.client() as ca, b.client() as cb:
        yield ca, cb


def test_a_session_exported_mid_generation_goes_on_elsewhere_with_the_tokens_it_would_have_had(nodes):
    ca, cb = nodes
    ref = cb.generate("ref", **ASK)
    assert len(ref.done["tokens"]) == 300
    ca.submit("m", **ASK)
    ca.wait_for(lambda e: e["event"] == "tokens" and e["id"] == "m", keep=True)  # it is generating
    state = ca.export("m")
    left = ca.collect(["m"])["m"]  # what node A streamed, and its done
    assert left.done["reason"] == R.EXPORTED and left.tokens == left.done["tokens"] == state["generated"]
    assert 1 <= len(state["generated"]) < 300 and state["recipe"] == cb.status()["node"]["recipe"]
    cb.resume("m", state)
    went = cb.collect(["m"])["m"]
    assert went.admission["event"] == "admitted" and went.done["reason"] == R.LENGTH
    assert state["generated"] + went.tokens == ref.done["tokens"]  # bitwise, none lost or repeated
    assert went.done["tokens"] == ref.done["tokens"] and went.done["text"] == ref.done["text"]
    streamed = "".join(e["text"] for e in left.events + went.events)
    assert streamed == ref.done["text"]
    lps = lambda events: [lp for e in events for lp in e.get("logprobs", [])]  # noqa: E731 (a text tail has none)
    assert lps(left.events + went.events) == lps(ref.events)
    assert went.done["usage"]["completion_tokens"] == 300 and went.done["usage"]["prompt_tokens"] == len(PROMPT)


def test_what_cannot_move_is_refused_clearly_and_counted(nodes):
    ca, cb = nodes
    with pytest.raises(RuntimeError, match="UNKNOWN_SESSION"):
        ca.export("nobody")
    ca.submit("j", **{**ASK, "max_tokens": 200}, response_format=None)
    ca.wait_for(lambda e: e["event"] == "tokens" and e["id"] == "j", keep=True)
    state = ca.export("j")
    ca.collect(["j"])
    cb.resume("other-recipe", {**state, "recipe": "mn1-not-this-one"})
    assert cb.collect(["other-recipe"])["other-recipe"].admission["reason"] == R.REJECTED_RECIPE_MISMATCH
    for bad, words in ((dict(max_tokens=len(state["generated"])), "above the tokens generated"),
                       (dict(recipe=None), "recipe"), (dict(generated=[10**9]), "outside")):
        cb.resume("bad", {k: v for k, v in {**state, **bad}.items() if v is not None})
        ev = cb.wait_for(lambda e: e.get("id") == "bad")
        assert ev["event"] == "error" and ev["code"] == R.BAD_REQUEST and words in ev["detail"], ev
    assert cb.status()["telemetry"]["bad_frames_total"] >= 3


def test_export_and_import_decode_as_typed_requests():
    state = {"tokens": [5, 6], "generated": [7], "max_tokens": 4, "recipe": "mn1-x", "sampling": {"seed": 3},
             "stop": ["\n"]}
    got = P.decode_request(P.import_request("s", state), 100)
    assert isinstance(got, P.Submit) and got.generated == [7] and got.tokens == [5, 6] and got.stop == ["\n"]
    assert got.sampling.seed == 3 and P.decode_request(P.encode_request(got), 100) == got  # the client's form too
    assert P.decode_request(P.encode_request(P.Export("s")), 100) == P.Export("s")
    with pytest.raises(P.ProtocolError, match="not text or messages"):
        P.decode_request(P.import_request("s", {**state, "tokens": None, "text": "hi"}), 100)
