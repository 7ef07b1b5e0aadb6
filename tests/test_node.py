"""The deployable node: real front and engine processes on the tiny model, over ipc://."""
import os
import signal

import msgpack
import pytest
import zmq

from helpers import (assert_as_promised, assert_clean, assert_consistent, assert_continues, children_of,
                     deterministic_node, logprob_entries, prompt, wait_until)
from ipc import protocol as P
from ipc import events as E
from ipc.shm import leftover_segments
from meshnode.core import reasons as R
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess
from meshnode.ops.models import cached_model
from meshnode.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def node(tiny_model):
    before = leftover_segments()
    n = NodeProcess(tiny_model, "--max-active", "4", "--max-queue", "8", "--threads", "0").start()
    yield n
    n.stop()
    assert_clean(n, before)


def test_submit_streams_tokens_then_done_with_usage(node, tiny_model):
    with node.client() as c:
        r = c.generate("a", tokens=prompt(5), max_tokens=6, ignore_eos=True)
    assert r.admission == {"event": "admitted", "id": "a", "state": "RUNNING", "reason": "ADMITTED"}
    d = r.done
    assert d["reason"] == R.LENGTH and d["tokens"] == r.tokens and len(r.tokens) == 6
    assert d["usage"]["prompt_tokens"] == 5 and d["usage"]["completion_tokens"] == 6
    assert d["usage"]["total_ms"] >= d["usage"]["ttft_ms"] > 0 and isinstance(d["text"], str)
    assert d["text"] == Tokenizer(tiny_model).decode(d["tokens"])  # the text is the tokens', not a guess


def test_next_turn_reuses_the_conversations_kv_for_its_client_only(node, tiny_model):
    """By default (deterministic mode, where the CPU holds it) the cache reuses the prompt's cells and
    recomputes the answer's, and the continuation is bitwise a cold run's; without the mode it reuses
    the answer's too and the continuation is a cold run's up to a numerical tie (docs/determinism.md)."""
    with node.client() as c:
        first = c.generate("turn1", tokens=prompt(100), max_tokens=10, ignore_eos=True)
        history = prompt(100) + first.tokens + prompt(70, salt=2)
        second = c.generate("turn2", tokens=history, max_tokens=8, ignore_eos=True, logprobs=2)
        info = c.status()["node"]
        det = deterministic_node(c, tiny_model)
    with node.client() as other:
        cold = other.generate("turn2-elsewhere", tokens=history, max_tokens=8, ignore_eos=True, logprobs=2)
    assert info["prefix_cache"] == "client"
    assert second.done["usage"]["cached_tokens"] == (100 if det else 100 + 10 - 1)
    assert cold.done["usage"]["cached_tokens"] == 0  # another client's KV is not shared by default
    assert_as_promised(second, cold, det)


def test_text_in_text_out(node):
    with node.client() as c:
        r = c.generate("t", text="hello mesh node", max_tokens=5, ignore_eos=True)
        tok_events = []
        c.submit("t2", text="hello mesh node", max_tokens=5, ignore_eos=True)
        while True:
            ev = c.recv()
            if ev["event"] == "tokens":
                tok_events.append(ev)
            if ev["event"] == "done":
                break
    assert r.done["usage"]["prompt_tokens"] > 3 and len(r.done["text"]) > 0
    assert "".join(e["text"] for e in tok_events) == ev["text"]  # streamed pieces add up to the final text


def test_seeded_sampling_over_the_wire_draws_what_the_engine_would(node):
    """The node samples with the session's own settings and (seed, index) draws: each token is what the
    engine's sampler picks from the logits the node reports (top 20 of them: with top_k 20 that is
    every candidate), it differs from greedy and from another seed, and two clients (no shared KV)
    asking the same get the same."""
    import numpy as np

    from meshnode.engine.sampling import sample

    s = Sampling(0.9, 20, 0.95, 42)
    job = dict(tokens=prompt(6), max_tokens=24, ignore_eos=True, logprobs=20)
    runs = {}
    for name, sampling in [("a", s), ("b", s), ("seed43", Sampling(0.9, 20, 0.95, 43)), ("greedy", None)]:
        with node.client() as c:  # a client of its own: the prefix cache is per client
            runs[name] = c.generate(name, sampling=sampling, **job)
    assert runs["a"].tokens == runs["b"].tokens
    assert runs["a"].tokens != runs["seed43"].tokens and runs["a"].tokens != runs["greedy"].tokens
    for i, (tok, entry) in enumerate(zip(runs["a"].tokens, logprob_entries(runs["a"]))):
        logits = np.full(512, -np.inf, np.float32)
        for t in entry["top"]:
            logits[t["token"]] = t["logprob"]
        assert sample(logits, s, i) == tok, f"token {i}"
    greedy = logprob_entries(runs["greedy"])
    assert all(e["token"] == e["top"][0]["token"] for e in greedy)


def test_cancel_and_unknown_cancel(node):
    with node.client() as c:
        c.submit("long", tokens=prompt(4), max_tokens=3000, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "tokens")
        c.cancel("long")
        done = c.wait_for(lambda e: e["event"] == "done")
        assert done["reason"] == R.CANCELLED and done["id"] == "long"
        before = c.status()["telemetry"]
        c.cancel("long")
        err = c.wait_for(lambda e: e["event"] == "error")
        assert err["code"] == R.UNKNOWN_SESSION and err["id"] == "long"
        after = c.status()["telemetry"]  # counted as what it is, not as a malformed frame
        assert after["unknown_sessions_total"] == before["unknown_sessions_total"] + 1
        assert after["bad_frames_total"] == before["bad_frames_total"]
        assert wait_until(lambda: c.status()["telemetry"]["kv_bytes"] == 0)


def test_duplicate_live_id_is_rejected(node):
    with node.client() as c:
        c.submit("dup", tokens=prompt(4), max_tokens=2000, ignore_eos=True)
        c.submit("dup", tokens=prompt(4), max_tokens=5)
        rej = c.wait_for(lambda e: e["event"] == "rejected")
        assert rej["reason"] == R.REJECTED_DUPLICATE and rej["detail"]
        c.cancel("dup")
        c.wait_for(lambda e: e["event"] == "done")


def test_rejections_for_sizes_and_recipe(node):
    with node.client() as c:
        c.submit("big", tokens=prompt(10), max_tokens=5000)
        assert c.wait_for(lambda e: e["event"] == "rejected")["reason"] == R.REJECTED_CONTEXT_TOO_LONG
        c.submit("rec", tokens=prompt(3), max_tokens=2, recipe="mn1-not-this-one")
        assert c.wait_for(lambda e: e["event"] == "rejected")["reason"] == R.REJECTED_RECIPE_MISMATCH
        recipe = c.status()["node"]["recipe"]
        assert c.generate("rec2", tokens=prompt(3), max_tokens=2, recipe=recipe).done["reason"] == R.LENGTH


def raw(node, frames):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(node.listen)
    s.send_multipart(frames)
    assert s.poll(5000), f"no answer to {frames!r}"
    ev = E.decode_event(s.recv_multipart())
    s.close()
    return ev


@pytest.mark.parametrize("frames, code", [
    ([b"MN0", msgpack.packb({"op": "ping"})], R.UNSUPPORTED_VERSION),
    ([b"MN1"], R.BAD_REQUEST),
    ([b"MN1", b"\xc1garbage"], R.BAD_REQUEST),
    ([b"MN1", msgpack.packb([1, 2, 3])], R.BAD_REQUEST),
    ([b"MN1", msgpack.packb({"op": "launch"})], R.BAD_REQUEST),
    ([b"MN1", msgpack.packb({"op": "submit", "id": 7, "tokens": [1], "max_tokens": 2})], R.BAD_REQUEST),
    ([b"MN1", msgpack.packb({"op": "submit", "id": "x", "tokens": [1], "max_tokens": "2"})], R.BAD_REQUEST),
    ([b"MN1", msgpack.packb({"op": "submit", "id": "x", "tokens": [1, 99999], "max_tokens": 2})], R.BAD_REQUEST),
    ([b"MN1", msgpack.packb({"op": "submit", "id": "x", "tokens": [1], "text": "a", "max_tokens": 2})], R.BAD_REQUEST),
    ([b"MN1", msgpack.packb({"op": "submit", "id": "x" * 129, "tokens": [1], "max_tokens": 2})], R.BAD_REQUEST),
    ([b"MN1", msgpack.packb({"op": "submit", "id": "x", "tokens": [1], "max_tokens": 2**40})], R.BAD_REQUEST),
    ([b"MN1", msgpack.packb({"op": "submit", "id": "x", "text": "a" * 300_000, "max_tokens": 2})], R.TOO_LARGE),
])
def test_malformed_frames_get_structured_errors_and_are_counted(node, frames, code):
    with node.client() as c:
        before = c.status()["telemetry"]["bad_frames_total"]
        ev = raw(node, frames)
        assert ev["event"] == "error" and ev["code"] == code and ev["detail"]
        assert c.status()["telemetry"]["bad_frames_total"] == before + 1
        assert c.ping()


def test_an_oversize_message_is_dropped_by_zmq_and_the_node_serves_on(node):
    """Over MAXMSGSIZE libzmq closes the sender's connection before the node sees a byte: nothing to
    answer or count (a payload over 1 MiB that does arrive is answered TOO_LARGE and counted, above)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(node.listen)
    s.send_multipart([b"MN1", b"\x00" * (2 * P.MAX_MESSAGE_BYTES + 4096)])  # over MAXMSGSIZE (2x): dropped by zmq
    s.close()
    with node.client() as c:
        assert c.generate("after", tokens=prompt(3), max_tokens=2).done["reason"] == R.LENGTH


def test_status_and_ping(node):
    with node.client() as c:
        assert c.ping()
        st = c.status()
        cap = c.status(prompt_tokens=300)["capacity"]
        never = c.status(prompt_tokens=100_000)["capacity"]
    info = st["node"]
    assert info["recipe"].startswith("mn1-") and info["engine_pid"] > 0 and info["version"]
    assert info["budgets"]["max_queue"] == 8 and info["budgets"]["effective_active_cap"] == 4
    assert "active_sessions" in st["telemetry"] and st["capacity"]["estimate_prompt_tokens"] == 512
    # the engine timed ticks at start: a first-token estimate from the first status on
    assert cap["estimate_prompt_tokens"] == 300 and cap["ttft_ms_estimate"] > 0 and cap["free_slots"] == 4
    assert cap["tick_model"]["samples"] >= 10 and "refused" not in cap
    # a prompt the node would refuse gets no estimate, and the reason it would be refused
    assert never["ttft_ms_estimate"] is None and never["refused"]["reason"] == R.REJECTED_CONTEXT_TOO_LONG


def test_telemetry_pub_publishes_complete_snapshots(node):
    from test_telemetry import PROTOCOL_KEYS

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"telemetry")
    sub.connect(node.telemetry)
    assert sub.poll(5000)
    topic, body = sub.recv_multipart()
    sub.close()
    snap = P.unpack(body)
    assert topic == b"telemetry" and set(PROTOCOL_KEYS) <= set(snap)


def test_queue_full_with_one_slot_and_two_queued(tiny_model):
    with NodeProcess(tiny_model, "--max-active", "1", "--max-queue", "2") as n, n.client() as c:
        for i in range(4):
            c.submit(f"q{i}", tokens=prompt(4, i), max_tokens=40, ignore_eos=True)
        res = c.collect([f"q{i}" for i in range(4)])
    assert [res[f"q{i}"].admission["reason"] for i in range(4)] == [R.ADMITTED, R.QUEUED, R.QUEUED,
                                                                      R.REJECTED_QUEUE_FULL]
    assert res["q1"].admission["state"] == "QUEUED" and res["q3"].done is None
    assert all(res[f"q{i}"].done["reason"] == R.LENGTH for i in range(3))


def test_engine_sigkill_mid_generation_loses_nothing(tiny_model):
    before = leftover_segments()
    jobs = {f"k{i}": dict(tokens=prompt(3 + 5 * i, i), max_tokens=400, ignore_eos=True, logprobs=2,
                          sampling=Sampling(0.7, 0, 1.0, i) if i % 2 else None) for i in range(4)}
    with NodeProcess(tiny_model, "--max-active", "4", "--deterministic") as n, n.client() as c:
        for sid, kw in jobs.items():
            c.submit(sid, **kw)
        want = c.collect(list(jobs))
        for sid, kw in jobs.items():
            c.submit(sid, **kw)
        c.wait_for(lambda e: e["event"] == "tokens", keep=True)
        pid = c.status()["node"]["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        got = c.collect(list(jobs), timeout_s=300)  # a restart and four re-prefills, on a machine that may be busy
        assert_continues(got, want, jobs, R.LENGTH, deterministic=deterministic_node(c, tiny_model))
        st = c.status()
        assert st["telemetry"]["engine"]["restarts"] == 1 and st["node"]["engine_pid"] not in (0, pid)
        prompts = sum(len(kw["tokens"]) for kw in jobs.values())
        assert st["telemetry"]["prefill_tokens_total"] > 2 * prompts  # the live sessions were re-prefilled
        assert c.generate("after", tokens=prompt(4), max_tokens=3).done["reason"] == R.LENGTH
    assert_clean(n, before)


def test_vanished_client_sessions_are_cancelled_and_kv_freed(node, zctx):
    ctx = zctx
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(node.listen)
    s.send_multipart(P.encode_request(P.Submit("gone", 100000 // 50, prompt(4), ignore_eos=True)))
    assert s.poll(5000)
    s.close()
    with node.client() as c:
        t = wait_until(lambda: (lambda t: t if t["active_sessions"] == 0 else None)(c.status()["telemetry"]))
        assert t["kv_bytes"] == 0 and t["client_faults_total"] >= 1
        assert c.generate("other", tokens=prompt(3), max_tokens=2).done["reason"] == R.LENGTH


def test_shutdown_leaves_no_process_segment_or_socket(tiny_model):
    before = leftover_segments()
    n = NodeProcess(tiny_model).start()
    kids = children_of(n.proc.pid)
    assert kids
    assert n.stop() == 0
    assert wait_until(lambda: all(not k.is_running() or k.status() == "zombie" for k in kids), 30)
    assert_clean(n, before)


@pytest.mark.slow
def test_serve_without_a_model_generates_and_serves_the_tiny_demo(tmp_path):
    with NodeProcess(None, env={"MESHNODE_CACHE": str(tmp_path)}) as n, n.client() as c:
        info = c.status()["node"]
        assert info["model"] == str(cached_model("tiny", cache_dir=tmp_path))
        assert c.generate("d", text="hi", max_tokens=3).done["reason"] == R.LENGTH
    assert os.path.basename(info["model"]).startswith("demo-tiny-seed0-")
    assert os.path.getsize(info["model"]) > 5_000_000


def test_generate_command_streams_to_the_terminal(node):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "meshnode", "generate", "--connect", node.listen, "--tokens", "3,4,5",
                          "--max-tokens", "4", "--ignore-eos"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == 4 and "[LENGTH]" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "meshnode", "generate", "--connect", node.listen, "--tokens", "3",
                          "--max-tokens", "99999"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "REJECTED_CONTEXT_TOO_LONG" in bad.stderr


def test_start_removes_a_dead_nodes_leftovers(tiny_model, tmp_path):
    stale_pid = 4_000_000  # above pid_max: never alive
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / f"engine-{stale_pid}-1.sock").write_text("")
    (run_dir / "node.sock").write_text("")  # a crashed node's socket; its lock is free
    shm = f"/dev/shm/meshnode_{stale_pid}_deadbeef"
    open(shm, "wb").close()
    with NodeProcess(tiny_model, run_dir=str(run_dir)) as n, n.client() as c:
        assert c.ping()
        assert not (run_dir / f"engine-{stale_pid}-1.sock").exists() and not os.path.exists(shm)


def test_pipelined_and_lockstep_nodes_give_the_same_tokens(tiny_model):
    """Pipelining changes when ticks are planned, never what comes out: including the endings the
    front cannot foresee (a stop token, known only once its tick is back)."""
    jobs = {f"p{i}": dict(tokens=prompt(2 + 9 * i, i), max_tokens=20 + 7 * i, logprobs=2, ignore_eos=True,
                          sampling=Sampling(0.9, 20, 0.9, i) if i % 2 else None) for i in range(5)}

    def run(depth, stops):
        with NodeProcess(tiny_model, "--pipeline-depth", depth, "--deterministic") as n, n.client() as c:
            for sid, kw in jobs.items():
                c.submit(sid, **kw, stop_tokens=stops.get(sid, []))
            return c.collect(list(jobs)), deterministic_node(c, tiny_model)

    first, det = run("1", {})
    greedy = [sid for sid, kw in jobs.items() if kw["sampling"] is None]
    stops = {sid: [first[sid].tokens[4]] for sid in greedy}
    (lockstep, _), (pipelined, _) = run("1", stops), run("2", stops)
    for sid in jobs:  # the batches differ with the timing: bitwise in deterministic mode, greedy and seeded
        if sid in stops:
            assert_consistent(pipelined[sid], reason=R.STOP)
            assert_consistent(lockstep[sid], reason=R.STOP)
            assert pipelined[sid].tokens[-1] == stops[sid][0] and lockstep[sid].tokens[-1] == stops[sid][0]
        else:
            assert_consistent(pipelined[sid], jobs[sid]["max_tokens"], R.LENGTH)
        if det or sid in stops:
            assert_as_promised(pipelined[sid], lockstep[sid], det)


def test_a_request_wrong_in_several_ways_gets_the_first_reason_of_the_documented_order(tiny_model):
    """draining, duplicate, recipe, context, then the queue: a client learns what to fix first."""
    import signal as sig

    with NodeProcess(tiny_model, "--max-active", "1", "--max-queue", "0", "--drain-timeout-s", "120") as n, \
            n.client() as c:
        c.submit("a", tokens=prompt(3), max_tokens=4000, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "tokens", keep=True)
        asks = [("a", dict(recipe="mn1-other", max_tokens=99_999), R.REJECTED_DUPLICATE),
                ("b", dict(recipe="mn1-other", max_tokens=99_999), R.REJECTED_RECIPE_MISMATCH),
                ("c", dict(max_tokens=99_999), R.REJECTED_CONTEXT_TOO_LONG),
                ("d", dict(max_tokens=4), R.REJECTED_QUEUE_FULL)]
        for sid, kw, _ in asks:
            c.submit(sid, tokens=prompt(3), **kw)
        got = [c.wait_for(lambda e, sid=sid: e["event"] == "rejected" and e["id"] == sid)["reason"]
               for sid, _, _ in asks]
        n.proc.send_signal(sig.SIGTERM)
        assert wait_until(lambda: c.status()["telemetry"]["draining"], 30)
        c.submit("a", tokens=prompt(3), max_tokens=99_999, recipe="mn1-other")
        draining = c.wait_for(lambda e: e["event"] == "rejected")["reason"]
        c.cancel("a")
        assert c.collect(["a"])["a"].done["reason"] == R.CANCELLED
    assert got == [want for _, _, want in asks] and draining == R.REJECTED_DRAINING
