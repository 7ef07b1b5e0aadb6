"""Malformed frames and overload: every bad input answered and counted, nothing lost."""
import random
import threading

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import protocol as P
from ipc import events as E
from meshnode.client import Client
from meshnode.core import reasons as R
from meshnode.dev.nodeproc import NodeProcess

# -- fuzzing the decoder ------------------------------------------------------------------------
ints = st.integers(-(2**63), 2**64 - 1)  # everything msgpack can carry
leaf = st.one_of(st.none(), st.booleans(), ints,
                 st.floats(allow_nan=True), st.text(max_size=300), st.binary(max_size=64))
tree = st.recursive(leaf, lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=12), kids,
                                                                                       max_size=6), max_leaves=30)
ops = st.sampled_from(["submit", "cancel", "status", "ping", "import", "kv", "export", "launch", "", 7, None])
deep = st.integers(1, 240).map(lambda n: _nested(n))  # as deep as msgpack's packer goes; json.dumps recursed
request = st.fixed_dictionaries({"op": ops}, optional={
    "id": st.one_of(st.text(max_size=140), ints), "tokens": st.one_of(st.lists(st.integers(-5, 600)), tree),
    "text": st.one_of(st.text(max_size=50), tree), "max_tokens": st.one_of(st.integers(-3, 2**40), tree),
    "sampling": st.one_of(st.fixed_dictionaries({}, optional={"temperature": leaf, "top_k": leaf, "top_p": leaf,
                                                               "seed": leaf}), tree),
    "stop_tokens": tree, "ignore_eos": tree, "recipe": tree,
    "response_format": st.one_of(tree, st.fixed_dictionaries({"type": st.just("json_schema"),
                                                              "schema": st.one_of(tree, deep)})),
    "messages": st.one_of(tree, st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": tree}))),
    "tools": tree, "embed": tree, "kv": tree, "generated": tree, "priority": tree})


def _nested(n: int) -> dict:
    v: dict = {"type": "object"}
    for _ in range(n):
        v = {"properties": {"a": v}}
    return v


def decode_only_structured(frames):
    try:
        P.decode_request(frames, 512)
    except P.ProtocolError as e:
        assert e.code in (R.BAD_REQUEST, R.UNSUPPORTED_VERSION, R.TOO_LARGE, R.UNKNOWN_SESSION) and e.detail


def _deep_bytes(n: int) -> bytes:
    """A schema of maps nested 2n deep as msgpack bytes (msgpack's own packer stops at 512; a client need not)."""
    level = b"\x81" + msgpack.packb("properties") + b"\x81" + msgpack.packb("a")
    return level * n + msgpack.packb({"type": "object"})


@pytest.mark.parametrize("schema", [{"type": "string", "default": b"\x00bin"}, {b"type": "string"},
                                    "1000 deep", {"type": "number", "maximum": float("inf")}],
                         ids=["bin value", "bin key", "1000 deep", "infinite number"])
def test_a_schema_that_is_no_json_is_that_requests_bad_request(schema):
    """Each of these ended the whole node (json.dumps in the front's loop: TypeError, RecursionError)."""
    head = {"op": "submit", "id": "s", "text": "hi", "max_tokens": 4}
    if schema == "1000 deep":  # the map's last value spliced in as raw bytes
        payload = (b"\x85" + msgpack.packb(head)[1:] + msgpack.packb("response_format") + b"\x82"
                   + msgpack.packb("type") + msgpack.packb("json_schema") + msgpack.packb("schema") + _deep_bytes(500))
    else:
        payload = msgpack.packb({**head, "response_format": {"type": "json_schema", "schema": schema}},
                                use_bin_type=True)
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request([P.VERSION, payload], 512)
    assert e.value.code == R.BAD_REQUEST and e.value.id == "s" and "schema" in e.value.detail


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=4))
def test_fuzz_arbitrary_frames(frames):
    decode_only_structured(frames)


@settings(max_examples=200, deadline=None)
@given(st.one_of(request, tree))
def test_fuzz_msgpack_trees(obj):
    decode_only_structured([P.VERSION, msgpack.packb(obj, use_bin_type=True)])


def test_every_submit_field_round_trips_through_the_wire_codec():
    """What a client sets is what the front decodes: every sampling field away from its default."""
    import dataclasses

    from meshnode.core.types import Sampling

    s = Sampling(temperature=0.7, top_k=12, top_p=0.8, seed=2**63 + 5, min_p=0.05, repeat_penalty=1.3,
                 repeat_last_n=17, presence_penalty=-0.5, frequency_penalty=0.25, logprobs=3)
    assert all(getattr(s, f.name) != f.default for f in dataclasses.fields(Sampling))
    sub = P.Submit("rt", 77, [5, 6], None, s, [9], True, "mn1-x", ["\n\n"], None)
    assert P.decode_request(P.encode_request(sub), 512) == sub
    chat = dataclasses.replace(sub, tokens=None, messages=[{"role": "user", "content": "hi"}])
    assert P.decode_request(P.encode_request(chat), 512) == chat
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}]
    for turn in (dict(add_generation_prompt=False), dict(continue_final_message=True, add_generation_prompt=False),
                 dict(continue_final_message=False, add_generation_prompt=True)):
        ask = dataclasses.replace(chat, messages=said, **turn)
        assert P.decode_request(P.encode_request(ask), 512) == ask


@pytest.mark.parametrize("turn, words", [
    (dict(add_generation_prompt=True, continue_final_message=True), "cannot both be true"),
    (dict(continue_final_message=True, messages=[{"role": "user", "content": "hi"}]), "the assistant's"),
    (dict(add_generation_prompt="yes"), "must be a bool"),
    (dict(continue_final_message=True, messages=None, text="x"), "only with messages"),
])
def test_vllms_turn_options_are_checked_by_the_node(turn, words):
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}]
    sub = P.Submit("t", 5, None, None, messages=said)
    body = {**{k: v for k, v in vars(sub).items() if v is not None and k != "sampling"}, **turn, "op": "submit"}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(P.ProtocolError, match=words):
        P.decode_request([P.VERSION, msgpack.packb(body)], 512)


def random_frames(rng: random.Random):
    kind = rng.randrange(6)
    if kind == 0:
        return [bytes(rng.randrange(256) for _ in range(rng.randrange(40)))]
    if kind == 1:
        return [P.VERSION, bytes(rng.randrange(256) for _ in range(rng.randrange(80)))]
    if kind == 2:
        return [b"MN2", msgpack.packb({"op": "ping"})]
    body = {"op": rng.choice(["submit", "cancel", "launch", 5]), "id": rng.choice(["f", 3, "x" * 200, None]),
            "tokens": rng.choice([[1, 2], [999999], "abc", None, [1] * 3]), "max_tokens": rng.choice([-1, "2", 2**50, 0])}
    if kind == 4:
        body = rng.choice([[1, 2], "str", 17, {"op": {"nested": [1]}}])
    return [P.VERSION, msgpack.packb(body), *([b"extra"] if kind == 5 else [])]


def test_three_thousand_random_frames_then_a_valid_session(tiny_model, zctx):
    rng = random.Random(1234)
    frames = [random_frames(rng) for _ in range(3000)]
    bad = 0
    for f in frames:
        try:
            P.decode_request(f, 512)
        except P.ProtocolError:
            bad += 1
    assert bad > 2800  # the rest are well-formed cancels of unknown ids: answered, not counted as bad
    with NodeProcess(tiny_model) as n, n.client() as c:
        ctx = zctx
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(n.listen)
        answers = 0
        for i in range(0, 3000, 250):  # read as we go: a client that never reads is a stalled client
            for f in frames[i:i + 250]:
                s.send_multipart(f)
            while answers < i + 250 and s.poll(5000):
                ev = E.decode_event(s.recv_multipart())
                assert ev["event"] == "error"
                answers += 1
        s.close()
        assert answers == 3000
        assert c.generate("valid", tokens=[3, 4, 5], max_tokens=4).done["reason"] == R.LENGTH
        assert c.status()["telemetry"]["bad_frames_total"] == bad


# -- overload -----------------------------------------------------------------------------------
def test_overload_thousand_submits_nothing_lost(tiny_model):
    with NodeProcess(tiny_model, "--max-active", "8", "--max-queue", "32") as n:
        with n.client() as c:
            rss0 = c.status()["telemetry"]["front_rss_bytes"]
        tally = {"submitted": 0, "admitted": 0, "rejected": 0, "done": 0, "double": 0}
        lock = threading.Lock()

        def worker(k):
            with Client(n.listen, timeout_s=60) as c:
                ids = [f"c{k}-{i}" for i in range(200)]
                for sid in ids:
                    c.submit(sid, tokens=[3 + k, 4, 5], max_tokens=4, ignore_eos=True)
                res = c.collect(ids, timeout_s=120)
                extra = c.recv(0.5)  # nothing more may come: no second done
            with lock:
                tally["submitted"] += len(ids)
                tally["admitted"] += sum(not r.rejected for r in res.values())
                tally["rejected"] += sum(r.rejected for r in res.values())
                tally["done"] += sum(r.done is not None for r in res.values())
                tally["double"] += extra is not None

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with n.client() as c:
            t = c.status()["telemetry"]
    assert tally["submitted"] == 1000 and tally["admitted"] + tally["rejected"] == 1000
    assert tally["done"] == tally["admitted"] and tally["double"] == 0 and tally["rejected"] > 0
    assert t["rejected_by_reason"][R.REJECTED_QUEUE_FULL] == tally["rejected"]
    assert t["kv_bytes"] == 0 and t["active_sessions"] == 0 and t["queue_depth"] == 0
    growth = t["front_rss_bytes"] - rss0
    print(f"overload: admitted {tally['admitted']} rejected {tally['rejected']} front RSS growth {growth / 2**20:.1f} MiB")
    assert growth < 64 * 2**20
