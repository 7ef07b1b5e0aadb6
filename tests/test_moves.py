"""Sessions that move between nodes: `export` on one, `import` of its state on another with the same recipe,
and the client's stream goes on there with the next token, none lost or repeated (docs/protocol.md). The KV
travels with it (llama.cpp's per-sequence state, checked by SHA-256 and by the tokens it was computed for), or,
without it, is prefilled again there."""
import hashlib
import tempfile

import pytest

from helpers import done_reasons, prompt, scheduler, session, step
from ipc import protocol as P
from ipc import moving as M
from meshnode.core import reasons as R
from meshnode.core.session import Session
from meshnode.core.types import Sampling
from meshnode.dev.hostile import mac_of, mesh_key
from meshnode.dev.nodeproc import NodeProcess
from meshnode.engine.followups import Followups
from meshnode.front.moves import read_key

# deterministic on both (the f32 tiny model's mode is bitwise across batch shapes and re-prefills); a tick
# takes at least 30 ms and one token, so a session of 300 is still running when the export comes
SLOW = {"faults": [{"step_sleep_s": 0.03}]}
BASE = ("--deterministic", "--decode-steps-ms", "0", "--threads", "1")  # one thread: several nodes at once
KEY = mesh_key(tempfile.mkdtemp())
ARGS = (*BASE, "--mesh-key-file", KEY)  # one mesh: its nodes load each other's KV
PROMPT = [3 + (k * 29) % 500 for k in range(37)]
ASK = dict(tokens=PROMPT, max_tokens=300, ignore_eos=True, sampling=Sampling(0.9, 40, 0.95, 11), logprobs=1)


@pytest.fixture(scope="module")
def nodes(tiny_model):
    with NodeProcess(tiny_model, *ARGS, internal=SLOW) as a, NodeProcess(tiny_model, *ARGS, internal=SLOW) as b, \
            a.client() as ca, b.client() as cb:
        yield ca, cb


@pytest.fixture(scope="module")
def reference(nodes):
    ref = nodes[1].generate("ref", **ASK)
    assert len(ref.done["tokens"]) == 300
    return ref


def leave(ca, id: str, ask=ASK) -> tuple[dict, object]:
    """A session started on node A and exported while it generates: its state and what A streamed."""
    ca.submit(id, **ask)
    ca.wait_for(lambda e: e["event"] == "tokens" and e["id"] == id, keep=True)  # it is generating
    state = ca.export(id)
    return state, ca.collect([id])[id]


@pytest.mark.parametrize("with_kv", [True, False], ids=["kv moved", "prefilled again"])
def test_a_session_exported_mid_generation_goes_on_elsewhere_with_the_tokens_it_would_have_had(nodes, reference,
                                                                                              with_kv):
    ca, cb = nodes
    ref = reference
    state, left = leave(ca, f"m{with_kv}")
    assert left.done["reason"] == R.EXPORTED and left.tokens == left.done["tokens"] == state["generated"]
    assert 1 <= len(state["generated"]) < 300 and state["recipe"] == cb.status()["node"]["recipe"]
    kv = state["kv"]  # every position but the last sampled token's, which it has not fed yet
    assert kv["positions"] == len(PROMPT) + len(state["generated"]) - 1
    assert len(kv["data"]) == kv["bytes"] and hashlib.sha256(kv["data"]).hexdigest() == kv["sha256"]
    if not with_kv:
        del state["kv"]
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
    # the moved KV is used, not recomputed: every position it holds (all but the last sample, fed there)
    assert went.done["usage"]["cached_tokens"] == (kv["positions"] if with_kv else 0)


def test_what_cannot_move_is_refused_clearly_and_counted(nodes):
    ca, cb = nodes
    with pytest.raises(RuntimeError, match="UNKNOWN_SESSION"):
        ca.export("nobody")
    state, _ = leave(ca, "j", {**ASK, "max_tokens": 200})
    cb.resume("other-recipe", {**state, "recipe": "mn1-not-this-one"})
    assert cb.collect(["other-recipe"])["other-recipe"].admission["reason"] == R.REJECTED_RECIPE_MISMATCH
    del state["kv"]
    for bad, words in ((dict(max_tokens=len(state["generated"])), "above the tokens generated"),
                       (dict(recipe=None), "recipe"), (dict(generated=[10**9]), "outside")):
        cb.resume("bad", {k: v for k, v in {**state, **bad}.items() if v is not None})
        ev = cb.wait_for(lambda e: e.get("id") == "bad")
        assert ev["event"] == "error" and ev["code"] == R.BAD_REQUEST and words in ev["detail"], ev
    assert cb.status()["telemetry"]["bad_frames_total"] >= 3


def test_export_and_import_decode_as_typed_requests():
    state = {"tokens": [5, 6], "generated": [7], "max_tokens": 4, "recipe": "mn1-x", "sampling": {"seed": 3},
             "stop": ["\n"]}
    got = P.decode_request(M.import_request("s", state), 100)
    assert isinstance(got, P.Submit) and got.generated == [7] and got.tokens == [5, 6] and got.stop == ["\n"]
    assert got.sampling.seed == 3 and P.decode_request(P.encode_request(got), 100) == got  # the client's form too
    assert P.decode_request(P.encode_request(P.Export("s")), 100) == P.Export("s")
    with pytest.raises(P.ProtocolError, match="not text or messages"):
        P.decode_request(M.import_request("s", {**state, "tokens": None, "text": "hi"}), 100)


def refusal(cb, id: str, state: dict, frames=None) -> dict:
    """What node B answers an import of `state` whose KV parts are `frames` (as the client sends them)."""
    cb.open[id] = cb.open.get(id, 0) + 1
    cb.sock.send_multipart(M.import_request(id, state))
    for f in M.kv_requests(id, state["kv"]["data"]) if frames is None else frames:
        cb.sock.send_multipart(f)
    return cb.collect([id])[id].admission


def test_a_kv_changed_cut_or_of_other_tokens_is_refused_before_admission(nodes):
    ca, cb = nodes
    state, _ = leave(ca, "k", {**ASK, "max_tokens": 200})
    kv, data = state["kv"], state["kv"]["data"]
    flipped = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    r = refusal(cb, "flip", {**state, "kv": {**kv, "data": flipped}})
    assert r["reason"] == R.REJECTED_BAD_REQUEST and "SHA-256" in r["detail"]
    # a part that does not follow the bytes received (the first ten lost): refused at once, not waited on
    r = refusal(cb, "cut", state, [P.encode_request(P.KvChunk("cut", 10, data[10:]))])
    assert r["reason"] == R.REJECTED_BAD_REQUEST and "in order" in r["detail"]
    # a KV whose own checksum is right but which another prompt computed, signed anew by a mesh member gone bad
    other = {**state, "tokens": [t + 1 for t in state["tokens"]]}
    r = refusal(cb, "other", {**other, "kv": {**kv, "mac": mac_of(read_key(KEY), other)}})
    assert r["reason"] == R.REJECTED_BAD_REQUEST and "other tokens" in r["detail"]
    r = refusal(cb, "huge", {**state, "kv": {**kv, "bytes": 1 << 40}}, [])
    assert r["reason"] == R.REJECTED_BAD_REQUEST and "positions take on this node" in r["detail"]
    junk = b"not a state" * 100
    r = refusal(cb, "junk", {**state, "kv": {**kv, "data": junk, "bytes": len(junk),
                                            "sha256": hashlib.sha256(junk).hexdigest()}})
    assert r["reason"] == R.REJECTED_BAD_REQUEST and "positions take on this node" in r["detail"]
    with pytest.raises(RuntimeError, match="UNKNOWN_SESSION"):  # a kv part of no import
        cb.sock.send_multipart(M.kv_requests("nobody", b"x")[0])
        ev = cb.wait_for(lambda e: e.get("id") == "nobody")
        raise RuntimeError(f"{ev['code']}: {ev['detail']}")
    cb.resume("k", state)  # and the import itself still goes on there after all that
    assert cb.collect(["k"])["k"].done["reason"] == R.LENGTH


# -- the policy's half, on the fake engine (no processes): what a move does to ticks in flight -------------------
def _pipelined(sched, eng, ticks, runner):
    """Run planned ticks in order, as the engine process does (follow-ups filled in), and apply each."""
    return [ev for tk in ticks for ev in sched.apply(tk, runner.run(eng, tk.plan))]


def test_ticks_in_flight_land_before_the_save_and_the_import_goes_on_with_the_same_draws(tmp_path):
    eng, sched = scheduler(steps_ms=0)
    s = session(("c", "a"), n_prompt=9, max_tokens=40, sampling=Sampling(0.8, 0, 1.0, 5))
    sched.submit(s)
    runner = Followups()
    _pipelined(sched, eng, [sched.plan() for _ in range(1)], runner)
    ahead = [sched.plan(), sched.plan()]  # two ticks in flight, the second following the first's sample
    assert sched.export(s.key, str(tmp_path / "a.kv")) == []  # it leaves once its save is answered
    save = sched.plan()
    assert [type(op).__name__ for op in save.plan.kv] == ["Save"] and not save.plan.chunks
    events = _pipelined(sched, eng, [*ahead, save], runner)
    kinds = [e.kind for e in events]
    assert kinds == ["tokens", "tokens", "exported", "done"] and events[-1].reason == R.EXPORTED
    path, positions, nbytes = events[2].kv
    assert positions == len(s.tokens) - 1 and nbytes > 0  # every token but the last sample, which it feeds there
    eng2, there = scheduler(steps_ms=0)
    moved = Session(("c", "b"), s.prompt, 40, s.sampling, tokens=list(s.tokens), kv_import=(path, positions))
    there.submit(moved)
    while there.live:
        step(there, eng2, there.plan())
    assert moved.n_reused == positions and eng2.expected(moved.tokens, len(s.prompt), seed=5)
    assert len(moved.tokens) == len(s.prompt) + 40


def test_a_session_that_ends_before_its_save_answers_its_export_with_that(tmp_path):
    eng, sched = scheduler(steps_ms=0)
    s = session(("c", "a"), n_prompt=5, max_tokens=3)
    sched.submit(s)
    runner = Followups()
    ahead = [sched.plan(), sched.plan(), sched.plan()]  # its last sample is in flight
    sched.export(s.key, str(tmp_path / "a.kv"))
    save = sched.plan()
    events = _pipelined(sched, eng, [*ahead, save], runner)
    assert [(e.kind, e.reason) for e in events if e.kind != "tokens"] == [("done", R.LENGTH), ("exported", R.LENGTH)]


def test_a_refused_save_is_planned_again_and_a_restart_sends_it_without_kv(tmp_path):
    eng, sched = scheduler(steps_ms=0)
    a, b = session(("c", "a"), n_prompt=5, max_tokens=30), session(("c", "b"), n_prompt=6, max_tokens=30, salt=1)
    sched.submit(a)
    sched.submit(b)
    for _ in range(2):
        step(sched, eng, sched.plan())
    sched.export(a.key, str(tmp_path / "a.kv"))
    refused = sched.plan()
    assert any(type(op).__name__ == "Save" for op in refused.plan.kv)
    sched.refused(refused)  # b's chunk in it ends ENGINE_ERROR; a's save did not run
    again = sched.plan()
    assert [type(op).__name__ for op in again.plan.kv] == ["Save"]
    sched.engine_restarted()  # that one is lost with the engine: a leaves with its tokens, no KV
    events = step(sched, eng, sched.plan())
    ex = [e for e in events if e.kind == "exported"]
    assert len(ex) == 1 and ex[0].kv is None and ex[0].reason is None and a.state == "DONE"


def test_a_kv_the_engine_cannot_load_ends_that_session_cache_miss_and_nobody_else(tmp_path):
    eng, sched = scheduler(steps_ms=0)
    other = session(("c", "o"), n_prompt=5, max_tokens=4)
    sched.submit(other)
    (tmp_path / "bad.kv").write_bytes(b"junk")
    moved = Session(("c", "m"), prompt(8), 10, tokens=prompt(8) + [7, 8], kv_import=(str(tmp_path / "bad.kv"), 9))
    sched.submit(moved)
    events = []
    while sched.live:
        events += step(sched, eng, sched.plan())
    assert done_reasons(events) == {moved.key: R.CACHE_MISS, other.key: R.LENGTH}


def test_a_node_killed_while_it_receives_a_kv_started_nothing_and_the_move_goes_on_elsewhere(nodes, tiny_model):
    """kill -9 of the importing node half-way through the KV: no `admitted` came, so the session never started
    there; the same state goes to another node and continues, every token once."""
    ca, _ = nodes
    ask = {**ASK, "tokens": [3 + (k * 13) % 500 for k in range(400)], "max_tokens": 60}
    ref = ca.generate("ref-long", **ask)
    state, left = leave(ca, "long", ask)
    parts = M.kv_requests("long", state["kv"]["data"])
    assert len(parts) >= 2  # 400 positions of the tiny model's KV: more than one part
    with NodeProcess(tiny_model, *ARGS) as victim, victim.client() as cv:
        cv.sock.send_multipart(M.import_request("long", state))
        cv.sock.send_multipart(parts[0])
        assert cv.status()["telemetry"]["active_sessions"] == 0  # the node read the part: nothing started
        victim.proc.kill()
        victim.proc.wait()
    ca.resume("long2", state)
    went = ca.collect(["long2"])["long2"]
    assert state["generated"] + went.tokens == ref.done["tokens"] and went.done["reason"] == R.LENGTH


def test_a_node_killed_during_an_export_loses_nothing_its_client_was_sent(nodes, reference, tiny_model):
    """kill -9 of the node a session runs on, its export asked: whatever the client holds (the `exported` state,
    if it came before the kill, else the request and the tokens streamed) goes on elsewhere, every token once."""
    from dataclasses import asdict

    _, cb = nodes
    with NodeProcess(tiny_model, *ARGS, internal=SLOW) as doomed, doomed.client() as cd:
        cd.submit("k", **ASK)
        cd.wait_for(lambda e: e["event"] == "tokens" and e["id"] == "k", keep=True)
        cd.send(P.Export("k"))
        doomed.proc.kill()
        doomed.proc.wait()
        events = []
        while (ev := cd.recv(0.5)) is not None:
            events.append(ev)
    got = [t for e in events if e["event"] == "tokens" for t in e["tokens"]]
    exported = [e["state"] for e in events if e["event"] == "exported"]
    assert [e["event"] for e in events].count("done") <= 1  # its EXPORTED done, if the export beat the kill
    state = {k: v for k, v in exported[0].items() if k != "kv"} if exported else {
        "tokens": PROMPT, "generated": got, "max_tokens": 300, "ignore_eos": True, "logprobs": 1,
        "recipe": cb.status()["node"]["recipe"], "sampling": {k: v for k, v in asdict(ASK["sampling"]).items()
                                                              if k != "logprobs"}}
    assert state["generated"] == got and 0 < len(got) < 300
    cb.resume("after-kill", state)
    went = cb.collect(["after-kill"])["after-kill"]
    assert got + went.tokens == reference.done["tokens"]


def test_one_client_holding_import_slots_open_starves_no_other():
    """64 imports of one client, each sending a byte now and then, refused every other client's import."""
    from ipc import seqstate
    from meshnode.front.moves import MAX_INCOMING_PER_CLIENT, Moves

    layout = seqstate.Layout(1, False, ((0, 16),), ((0, 4, 0),))
    moves = Moves(layout, 8, lambda: 0.0, max_bytes=10 * layout.size(8, 8))
    ask = lambda id: P.Submit(id, 4, tokens=prompt(8), kv=P.KvHeader(layout.size(8, 8), "0" * 64, 8))  # noqa: E731
    try:
        assert all(moves.begin(b"a", ask(f"a{i}")) == "" for i in range(MAX_INCOMING_PER_CLIENT))
        assert "of this client" in moves.begin(b"a", ask("a-more"))
        assert moves.begin(b"b", ask("b0")) == ""
        for i in range(5):
            moves.begin(bytes([i]), ask("x"))
        assert "bytes of KV" in moves.begin(b"c", ask("c0"))  # the bytes receiving at once are bounded too
    finally:
        moves.close()


def test_without_a_mesh_key_or_curve_keys_an_imports_kv_is_not_loaded_and_it_goes_on_prefilled(tiny_model):
    """KV is loaded only from peers that prove who they are (a parsed state file cannot show its numbers are the
    model's): between nodes that share neither a mesh key nor CURVE keys, the session moves with the same tokens,
    its KV computed again where it lands."""
    with NodeProcess(tiny_model, *BASE, internal=SLOW) as a, NodeProcess(tiny_model, *BASE, "--prefix-cache", "off",
                                                                          internal=SLOW) as b, \
            a.client() as ca, b.client() as cb:
        ref = cb.generate("ref", **{**ASK, "max_tokens": 30})
        state, left = leave(ca, "m", {**ASK, "max_tokens": 30})
        assert state["kv"]["bytes"] > 0
        cb.resume("m", state)
        went = cb.collect(["m"])["m"]
    assert went.done["usage"]["cached_tokens"] == 0 and went.done["reason"] == R.LENGTH
    assert state["generated"] + went.tokens == ref.done["tokens"]


def test_with_a_mesh_key_only_kv_a_mesh_node_signed_is_loaded_and_the_rest_is_prefilled(tiny_model, tmp_path):
    """--mesh-key-file: exports carry an HMAC of their KV, recipe and tokens; an import's KV without a valid one
    (a client's own, another mesh's, a signature moved onto other bytes) is not loaded, and the session goes on
    prefilled, with the same tokens."""
    from pathlib import Path

    from helpers import serve

    key = Path(mesh_key(tmp_path))
    args = (*BASE, "--mesh-key-file", str(key))
    # B's prefix cache off: a hit on the cells of the session imported before would count as cached too
    with NodeProcess(tiny_model, *args, internal=SLOW) as a, \
            NodeProcess(tiny_model, *args, "--prefix-cache", "off", internal=SLOW) as b, \
            NodeProcess(tiny_model, *BASE, internal=SLOW) as outsider, a.client() as ca, b.client() as cb, \
            outsider.client() as co:
        signed, _ = leave(ca, "s", {**ASK, "max_tokens": 30})
        unsigned, _ = leave(co, "u", {**ASK, "max_tokens": 30, "tokens": [t + 1 for t in PROMPT]})
        assert len(signed["kv"]["mac"]) == 64 and "mac" not in unsigned["kv"]
        forged = {**unsigned, "kv": {**unsigned["kv"], "mac": signed["kv"]["mac"]}}  # a signature of other bytes
        got = {}
        for name, state in (("signed", signed), ("unsigned", unsigned), ("forged", forged)):
            cb.resume(name, state)
            got[name] = cb.collect([name])[name].done
    assert got["signed"]["usage"]["cached_tokens"] == signed["kv"]["positions"]
    for name in ("unsigned", "forged"):
        assert got[name]["reason"] == R.LENGTH and got[name]["usage"]["cached_tokens"] == 0
    assert got["unsigned"]["tokens"] == got["forged"]["tokens"]
    key.chmod(0o644)
    out = serve(tiny_model, "--mesh-key-file", str(key))
    assert out.returncode != 0 and "chmod 600" in out.stderr
