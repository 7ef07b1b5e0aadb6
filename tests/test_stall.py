"""No valid request may stall the node: bounded front work, engine-side liveness, bounded restarts."""
import os
import random
import signal
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_as_promised, assert_consistent, deterministic_node, wait_until
from meshnode.core import reasons as R
from meshnode.core.types import Plan
from meshnode.dev.nodeproc import NodeProcess
from meshnode.text import tokenizer as T
from meshnode.text.jobs import TextJobs

# the worst texts found for llama.cpp's SPM tokenizer: characters the vocab lacks, so every one is a
# byte-fallback symbol (4.2 s for 256 KiB of tabs through plain llama_tokenize on this machine)
WORST = {"tabs": "\t" * 262144, "nul": "\x00" * 262144, "cjk": "中" * 87381, "emoji": "😀" * 65536}


@pytest.fixture(scope="module")
def tok(tiny_model):
    t = T.Tokenizer(tiny_model)
    yield t
    t.close()


# -- the tokenizer: exact, linear, and a free lower bound ---------------------------------------
ALPHABET = list("ab the\t\n中😀~<>0x\x00 ▁é") + ["the ", " mesh", "<0x41>", "<s>", "</s>", "<unk>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=80), st.booleans())
def test_linear_encode_equals_llama_cpp_on_any_text(tok, parts, bos):
    text = "".join(parts)
    old, T.SLICE_BYTES = T.SLICE_BYTES, 5  # cut every few characters: short texts exercise the cutting
    try:
        assert tok.encode(text, bos) == tok._tokenize(text, bos)
    finally:
        T.SLICE_BYTES = old
    assert tok.min_tokens(text) <= len(tok._tokenize(text, False))


@pytest.mark.parametrize("name", sorted(WORST))
def test_worst_texts_tokenize_exactly_in_short_slices(tok, name):
    """Linear time by construction: llama.cpp never sees more than a slice of text at once (what a
    slice costs, and the whole, is in `python -m benchmarks abuse`; plain llama_tokenize took 1-4 s)."""
    text = WORST[name]
    slices = list(tok.slices(text))
    got = [t for s in slices for t in s]
    assert got[:1] == [1] and len(got) == len(text.encode()) + 2  # BOS, the space prefix, one byte token each
    assert got[2:100] == tok._tokenize(text[:98], True)[2:100]
    assert len(slices) >= len(text) // (2 * T.SLICE_BYTES) and max(map(len, slices)) <= 2 * T.SLICE_BYTES * 4


# -- tokenization off the loop ----------------------------------------------------------------
def finish(jobs, n):
    got, deadline = [], time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got += jobs.finished()
        time.sleep(0.001)
    return got


def test_text_jobs_run_off_the_caller_in_order_and_bound_their_backlog():
    import threading

    release = threading.Event()

    def slow_slices(text):
        release.wait(5)
        yield [len(text)]

    jobs = TextJobs(slow_slices, max_backlog_chars=10)
    try:
        assert jobs.submit("a", "xxxx") and jobs.submit("b", "yyyy")
        assert not jobs.submit("c", "zzz")  # 8 + 3 > 10: refused at once, nothing queued
        assert jobs.finished() == []  # the caller never waits for the worker
        release.set()
        assert [(j.key, j.tokens) for j in finish(jobs, 2)] == [("a", [4]), ("b", [4])]
        assert jobs.backlog_chars == 0 and jobs.jobs_total == 2
    finally:
        jobs.close()


def test_a_short_text_waits_for_one_slice_of_each_long_one_not_for_all_of_them():
    """Ten slices each from two clients, then a one-slice text from a third: the worker takes turns,
    so the third is done after at most two turns of each (its slice, then its end), whatever the
    others' length; one client's own texts still finish in order."""
    import threading

    gate, log = threading.Event(), []

    def slices(text):
        if text == "gate":
            gate.wait(5)
        for k in range(len(text)):
            log.append(text[0])
            yield [k]

    jobs = TextJobs(slices)
    try:
        jobs.submit("g", "gate", owner="G")  # holds the worker until everything below has arrived
        jobs.submit("a1", "a" * 10, owner="A")
        jobs.submit("a2", "aa", owner="A")
        jobs.submit("b", "b" * 10, owner="B")
        jobs.submit("c", "c", owner="C")
        gate.set()
        order = [j.key for j in finish(jobs, 5)]
    finally:
        jobs.close()
    assert order.index("c") < order.index("a1") and order.index("c") < order.index("b")
    assert order.index("a1") < order.index("a2")
    before_c = log[:log.index("c")]
    assert before_c.count("a") <= 2 and before_c.count("b") <= 2


# -- the hang rule, by the engine's heartbeat ---------------------------------------------------
def test_an_answer_waiting_unread_is_never_a_hang_but_an_unfinished_tick_is():
    from meshnode.core.health import EngineHealth
    from meshnode.core.pipeline import Tick

    health = EngineHealth(tick_deadline_s=1.0, start_timeout_s=300.0, restart_timeout_min_s=10.0)
    sent = [Tick(1, Plan(), sent_at=100.0), Tick(2, Plan(), sent_at=100.0)]
    assert health.hung(101.5, sent, lambda: (2, 2, 100.2)) == ""  # both ticks done at 100.2; the front was away
    assert health.hung(3700.0, sent, lambda: (2, 2, 100.2)) == ""  # however long the front was busy
    assert health.hung(100.9, sent, lambda: (1, 0, 100.1)) == ""  # tick 1 started and running: not late yet
    why = health.hung(101.5, sent, lambda: (1, 0, 100.1))
    assert "tick 1" in why and "in its step" in why
    why = health.hung(101.5, sent, lambda: (1, 1, 100.2))  # tick 1 done, tick 2 sent and never taken
    assert "tick 2" in why and "without taking it" in why
    assert health.hung(101.5, [Tick(3, Plan(), sent_at=101.0)], lambda: (2, 2, 100.2)) == ""  # sent just now


# -- through a node -------------------------------------------------------------------------------
def stream_gaps(c, sid):
    """(largest gap between two tokens of `sid`, its done) while the caller's traffic goes on."""
    times, done = [], None
    while done is None:
        ev = c.wait_for(lambda e: e.get("id") == sid and e["event"] in ("tokens", "done"), 60)
        if ev["event"] == "tokens":
            times.append(time.monotonic())
        else:
            done = ev
    return max(np.diff(times)), done


def test_huge_texts_do_not_stall_a_streaming_session(tiny_model):
    """The issue's abuse: 256 KiB texts of characters the vocab lacks, 5 times each, while another
    session streams. The context is large enough that each one really is tokenized."""
    with NodeProcess(tiny_model, "--kv-layout", "unified", "--ctx", "65536", "--tick-deadline-s", "2") as n, n.client() as c:
        c.submit("stream", tokens=[3, 4, 5], max_tokens=600, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "tokens", keep=True)
        ids = []
        for name, text in WORST.items():
            for k in range(5):
                ids.append(f"{name}{k}")
                c.submit(ids[-1], text=text, max_tokens=1)
        order, times = [], []  # every event of this client, as it came
        while len([e for e in order if e[1] == "rejected"]) < len(ids) or ("stream", "done") not in order:
            ev = c.recv(60)
            assert ev is not None, "the node went silent"
            order.append((ev.get("id"), ev["event"]))
            if order[-1] == ("stream", "tokens"):
                times.append(time.monotonic())
        t = c.status()["telemetry"]
    worst = max(np.diff(times))
    print(f"largest gap while 20 huge texts were tokenized: {worst * 1e3:.0f} ms (bench abuse measures it)")
    rejected = [i for i, (sid, kind) in enumerate(order) if kind == "rejected"]
    # the stream decoded all through the tokenizing (it took turns off the loop): tokens came between the
    # answers to the texts, not only before the first and after the last
    between = [i for i, e in enumerate(order) if e == ("stream", "tokens") and rejected[0] < i < rejected[-1]]
    assert len(between) >= 10, (len(between), rejected[:3], rejected[-3:])
    assert ("stream", "done") in order and all(sid in ids for sid, kind in order if kind == "rejected")
    assert t["engine"]["restarts"] == 0 and t["rejected_by_reason"][R.REJECTED_CONTEXT_TOO_LONG] == len(ids)


def test_a_text_that_cannot_fit_is_refused_without_tokenizing(tiny_model):
    with NodeProcess(tiny_model) as n, n.client() as c:
        c.submit("big", text="\t" * 262144, max_tokens=1)
        c.submit("chat", messages=[{"role": "user", "content": "\t" * 200000}], max_tokens=1)
        rejected = [c.wait_for(lambda e: e["event"] == "rejected") for _ in range(2)]
        c.submit("small", text="hello", max_tokens=1)
        c.collect(["small"])
        t = c.status()["telemetry"]
    assert [r["reason"] for r in rejected] == [R.REJECTED_CONTEXT_TOO_LONG] * 2
    assert t["tokenizer_jobs_total"] == 1  # only the text that could fit went to the tokenizer


def test_a_clients_requests_are_answered_in_order_behind_its_text(tiny_model):
    """A cancel sent right after a text submit finds the session, though the text was still being
    tokenized when the cancel arrived."""
    with NodeProcess(tiny_model, "--kv-layout", "unified", "--ctx", "65536") as n, n.client() as c:
        c.submit("t", text="hello mesh " * 2000, max_tokens=2000, ignore_eos=True)
        c.cancel("t")
        c.submit("after", tokens=[3, 4], max_tokens=2)
        evs = [c.wait_for(lambda e: e.get("id") in ("t", "after") and e["event"] != "tokens") for _ in range(4)]
    assert [(e["id"], e["event"]) for e in evs] == [("t", "admitted"), ("t", "done"), ("after", "admitted"),
                                                    ("after", "done")]
    assert evs[1]["reason"] == R.CANCELLED


JOB = dict(tokens=[3 + k * 7 % 500 for k in range(9)], max_tokens=120, ignore_eos=True, logprobs=2)


def test_an_incarnation_stopped_at_hello_is_replaced_within_the_derived_deadline(tiny_model):
    with NodeProcess(tiny_model) as n, n.client() as c:
        want = c.generate("ref", **JOB)
    faults = [{"kind": "kill", "at_tick": 30}, {"stop_at_hello": True}, {}]
    with NodeProcess(tiny_model, "--restart-timeout-min-s", "1", internal={"faults": faults}) as n, \
            n.client() as c:
        node = c.status()["node"]
        deadline = node["engine_hello_deadline_s"]
        c.submit("s", **JOB)
        got = c.collect(["s"], timeout_s=120)["s"]
        t = c.status()["telemetry"]
        log = n.log()
        det = deterministic_node(c, tiny_model)
    print(f"first start {node['engine_first_start_s']:.2f} s -> restart deadline {deadline:.2f} s")
    assert deadline == max(1.0, 5 * node["engine_first_start_s"])
    assert f"did not say hello within {deadline:.1f} s" in log  # the derived deadline, not the first start's 300 s
    assert_consistent(got, JOB["max_tokens"], R.LENGTH)
    assert_as_promised(got, want, det)
    # the kill and the incarnation stopped at hello, in that order; a busy machine may add a late hello of its own
    assert t["engine"]["restarts"] >= 2 and t["healthy"]
    assert log.index("did not say hello") > log.index("engine died")


def test_a_front_that_was_stopped_does_not_kill_a_healthy_engine(tiny_model):
    """The front stops for three tick deadlines, twice, while the engine has answered everything it
    was sent: the answers wait unread, which is no hang."""
    with NodeProcess(tiny_model, "--tick-deadline-s", "2") as n, n.client() as c:
        want = c.generate("ref", **JOB)
        c.submit("s", **JOB)
        c.wait_for(lambda e: e["event"] == "tokens", keep=True)
        for _ in range(2):
            n.proc.send_signal(signal.SIGSTOP)
            time.sleep(6 + random.random() * 0.05)
            n.proc.send_signal(signal.SIGCONT)
            time.sleep(0.05)
        got = c.collect(["s"], timeout_s=60)["s"]
        t = c.status()["telemetry"]
        det = deterministic_node(c, tiny_model)
    assert t["engine"]["restarts"] == 0, n.log()
    assert_consistent(got, JOB["max_tokens"], R.LENGTH)
    assert_as_promised(got, want, det)  # its prompt's KV came from the prefix cache


def test_a_stopped_engine_mid_generation_is_a_hang(tiny_model):
    """The other side of the same rule: the engine itself stops mid-decode; its heartbeat says so."""
    with NodeProcess(tiny_model, "--tick-deadline-s", "4") as n, n.client() as c:
        want = c.generate("ref", **JOB)
        c.submit("s", **JOB)
        c.wait_for(lambda e: e["event"] == "tokens", keep=True)
        os.kill(c.status()["node"]["engine_pid"], signal.SIGSTOP)
        got = c.collect(["s"], timeout_s=60)["s"]
        t = c.status()["telemetry"]
        det = deterministic_node(c, tiny_model)
    assert t["engine"]["restarts"] == 1
    assert_consistent(got, JOB["max_tokens"], R.LENGTH)
    assert_as_promised(got, want, det)


# -- client work metered -----------------------------------------------------------------------
def test_client_work_gets_its_share_and_no_more():
    from meshnode.core.cpushare import CpuShare

    share = CpuShare(now=0.0, share=0.25, burst_s=0.02)
    assert share.available(0.0) == 0.02  # a quiet node answers a burst at once
    share.spend(0.05)  # one costly slice overdraws it
    assert share.available(0.0) == 0.0 and share.wait_s(0.0) == pytest.approx(0.12)  # 0.03 s owed at 0.25
    assert share.wait_s(0.119) > 0 and share.wait_s(0.121) == 0
    share.spend(share.available(10.0))
    spent, t = 0.0, 10.0
    while t < 20.0:  # a flood that takes all it is given, for 10 s
        t += 0.001
        got = share.available(t)
        share.spend(got)
        spent += got
    assert spent == pytest.approx(2.5, rel=0.01)  # a quarter of the time, whatever the demand


def test_idle_metrics_connections_cannot_keep_a_scrape_out(tiny_model):
    import socket
    import urllib.request

    from ipc.transport import free_tcp_port
    from meshnode.front.metrics import MAX_CONNECTIONS

    port = free_tcp_port()
    with NodeProcess(tiny_model, "--metrics-listen", f"127.0.0.1:{port}"):
        wait_until(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read(), 60)
        # a client holding every slot idle (renewing them faster than TIMEOUT_S closes them): the oldest gives
        # way to each new connection, so the scrape gets in at once, not when the idle ones time out
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + 4)]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        for s in idle:
            s.close()
    assert body and b"meshnode_requests_running" in body
