"""Client faults: readers that stall, text that ends mid-character, a stalled client's overflow (the connections
themselves: test_connections.py)."""
import subprocess
import sys
import time

import pytest

from helpers import deaf_client, wait_until
from ipc import protocol as P
from ipc import events as E
from meshnode.core import reasons as R
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess


# -- client faults --------------------------------------------------------------------------------
# a tokens event a token (one decode step a tick: core/steps.py): enough messages to fill a client's queue
ONE_STEP = ("--decode-steps-ms", "0")


def test_client_that_stops_reading_loses_its_sessions_only(tiny_model, zctx):
    with NodeProcess(tiny_model, "--max-active", "8", "--ctx", "8192", *ONE_STEP) as n:
        s = deaf_client(zctx, n.listen)
        for i in range(6):  # never read: the node's send queue to us fills up
            s.send_multipart(P.encode_request(P.Submit(f"stall{i}", 1000, [3 + i, 4], ignore_eos=True)))
        with n.client() as c:
            assert c.generate("meanwhile", tokens=[3, 4, 5], max_tokens=5).done["reason"] == R.LENGTH
            t = wait_until(lambda: (lambda t: t if t["client_faults_total"] >= 1 and t["active_sessions"] == 0
                                    else None)(c.status()["telemetry"]), 30)
            assert t and t["kv_bytes"] == 0
            assert c.generate("after", tokens=[3, 4, 5], max_tokens=5).done["reason"] == R.LENGTH
        s.close()


def test_a_client_that_pauses_reading_still_gets_every_done(tiny_model, zctx):
    """Eight sessions stream to a client that stops reading for a while: the node cancels them when
    its send queue to the client is full, and keeps each `done` until the client reads again."""
    with NodeProcess(tiny_model, "--max-active", "8", "--ctx", "8192", *ONE_STEP) as n:
        s = deaf_client(zctx, n.listen)
        ids = [f"p{i}" for i in range(8)]
        for i, sid in enumerate(ids):
            s.send_multipart(P.encode_request(P.Submit(sid, 900, [3 + i, 4], ignore_eos=True)))
        with n.client() as c:  # the pause: until the node gives up on this client's sessions
            assert wait_until(lambda: c.status()["telemetry"]["client_faults_total"] >= 1, 30)
            stalled = c.status()["telemetry"]
        done, admitted, deadline = {}, set(), time.monotonic() + 30
        while len(done) < len(ids) and time.monotonic() < deadline:  # reading again
            if s.poll(1000):
                ev = E.decode_event(s.recv_multipart())
                if ev["event"] == "admitted":
                    admitted.add(ev["id"])
                elif ev["event"] == "done":
                    assert ev["id"] not in done
                    done[ev["id"]] = ev
        assert s.poll(300) == 0 or E.decode_event(s.recv_multipart())["event"] == "tokens"
        s.close()
        with n.client() as c:
            t = c.status()["telemetry"]
    assert admitted == set(ids) and set(done) == set(ids)
    assert {d["reason"] for d in done.values()} == {R.CANCELLED}
    assert all("stopped reading" in d["detail"] and d["tokens"] for d in done.values())
    assert stalled["clients_stalled"] == 1 and t["clients_stalled"] == 0 and t["kv_bytes"] == 0


# -- text and sampling edges ----------------------------------------------------------------------


def test_streamed_text_adds_up_to_the_final_text_even_mid_character(tiny_model):
    """The fake engine samples byte tokens about half the time, so sessions of these lengths end
    inside a multi-byte character; the piece held back then comes out before the done."""
    ended_mid_character = 0
    with NodeProcess(tiny_model, internal={"engine_kind": "fake"}) as n, n.client() as c:
        for i in range(20):
            c.submit(f"u{i}", tokens=[3 + i, 4], max_tokens=7 + i, ignore_eos=True)
            pieces, toks = [], []
            while (ev := c.recv())["event"] != "done":
                if ev["event"] == "tokens":
                    pieces.append(ev["text"])
                    toks += ev["tokens"]
            assert "".join(pieces) == ev["text"] and toks == ev["tokens"]
            ended_mid_character += ev["text"].endswith("\ufffd")
    assert ended_mid_character  # the case under test did happen


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30])
def test_a_vanishing_temperature_is_greedy_without_numeric_warnings(temperature):
    import warnings

    import numpy as np

    from meshnode.engine.sampling import sample

    logits = np.random.default_rng(3).standard_normal(512).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow / invalid-value warnings fail the test
        got = {sample(logits, Sampling(temperature, 0, 1.0, seed), draw) for seed, draw in [(1, 0), (2, 7), (9, 3)]}
    assert got == {int(np.argmax(logits))}


def test_a_stalled_client_gets_what_was_kept_and_the_overflow_is_counted(tiny_model, zctx):
    """Requests from a client that reads nothing: its queue fills (1000), then up to 1024 final answers
    are kept, and each one beyond is dropped and counted; when it reads again it gets every answer that
    was not counted as undeliverable, in order, each once."""
    import zmq

    from meshnode.front.outbox import MAX_PENDING

    with NodeProcess(tiny_model) as n, n.client() as watcher:
        # answers to start-up pings whose clients had already gone count too: only this test's are compared
        first = watcher.status()["telemetry"]
        count = lambda key: watcher.status()["telemetry"][key] - first[key]  # noqa: E731
        dropped = lambda: count("undeliverable_total")  # noqa: E731
        s = deaf_client(zctx, n.listen)
        s.setsockopt(zmq.SNDTIMEO, 120_000)  # the node always reads: a send that waits this long is a fault
        # Sent in rounds until one overflows: besides the 1000 queued and 1024 kept, the kernel's socket
        # buffer holds anything from none to ~1,500 more answers (many when ZeroMQ writes them in 8 KiB
        # batches, as it does when its I/O thread was descheduled), so no fixed count overflows every time.
        # A round is over once the node has answered every cancel in it (each one counted as an unknown
        # session): whatever it could not deliver nor keep is counted by then. Status is polled every 0.2 s:
        # it is client work too, metered in wall time (a hogged run).
        n_sent = 0
        while n_sent < 10_000 and not dropped():
            for i in range(n_sent, n_sent + 1000):
                s.send_multipart(P.encode_request(P.Cancel(f"x{i}")))
            n_sent += 1000
            assert wait_until(lambda: count("unknown_sessions_total") == n_sent, 120, every_s=0.2)
        assert dropped(), f"{n_sent} unread answers never overflowed"
        got = []  # read until every request is accounted for: delivered, or counted as dropped

        def accounted():
            while s.poll(1000):
                got.append(E.decode_event(s.recv_multipart())["id"])
            return len(got) + dropped() >= n_sent

        wait_until(accounted, 300, every_s=0)
        n_dropped = dropped()
        s.close()
    assert len(got) + n_dropped == n_sent and len(set(got)) == len(got)
    assert got == sorted(got, key=lambda i: int(i[1:]))  # in the order the requests came
    assert MAX_PENDING <= len(got) < n_sent


def test_the_telemetry_pub_holds_64_subscribers_and_a_silent_connection_is_dropped(tiny_model, zctx):
    import socket

    import zmq

    from meshnode.front.clients import TELEMETRY_SUBSCRIBERS
    from ipc.transport import HANDSHAKE_S

    with NodeProcess(tiny_model) as n, n.client() as c:
        ctx = zctx
        subs = []
        for _ in range(TELEMETRY_SUBSCRIBERS + 6):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(n.telemetry)
            subs.append(sub)
        t = wait_until(lambda: (lambda t: t if t["subscribers_connected"] == TELEMETRY_SUBSCRIBERS else None)(
            c.status()["telemetry"]), 30)
        assert t and t["subscribers_connected"] == TELEMETRY_SUBSCRIBERS
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # connects, never speaks ZMTP
        silent.connect(n.listen[len("ipc://"):])
        silent.settimeout(HANDSHAKE_S + 30)
        while silent.recv(4096):  # the node's greeting, then the end once the handshake deadline passes
            pass
        silent.close()
        for sub in subs:
            sub.close()


def test_a_connection_just_sent_a_stream_is_not_the_one_given_up(zctx):
    """At the cap, eviction takes the connection quiet longest in both directions. A client whose session
    ended may not have read its stream yet: the end (its `done`) can still sit in ZeroMQ's queue on the
    node's side, and closing the connection would lose it (seen once under load in
    test_idle_clients_give_way_to_new_ones_and_busy_ones_never_do). So the answers sent count as use,
    as the requests heard do: the client that was streamed to last is given up last."""
    import zmq

    from ipc.transport import free_tcp_port
    from meshnode.front import gate as G

    clock = [0.0]
    router = zctx.socket(zmq.ROUTER)
    ep = f"tcp://127.0.0.1:{free_tcp_port()}"
    router.bind(ep)
    g = G.Gate(router, ep, cap=2, busy=set, evict_after_s=1.0, clock=lambda: clock[0])
    try:
        g.heard(101, b"streamed")  # submitted first ...
        clock[0] = 1.0
        g.heard(102, b"pinged")  # ... then a ping, answered
        g.sent(b"pinged")
        for t in (2.0, 3.0, 4.0):  # the stream's tokens and its done, after that
            clock[0] = t
            g.sent(b"streamed")
        clock[0] = 10.0
        assert g._idlest() == 102
        g.sent(b"unknown")  # an answer to an identity with no connection here changes nothing
        assert g._idlest() == 102
    finally:
        g.close()
        router.close()


def test_an_unclosed_client_in_a_reference_cycle_does_not_hang_the_garbage_collector():
    """pyzmq's own finalizer deadlocks on a context collected with its sockets (the clients' finalizer
    closes them first); run where the tests' guard (conftest.py) is not installed."""
    code = ("import gc, threading\nfrom meshnode.client import Client\n"
            "def leak():\n    c = Client('ipc:///nonexistent/node.sock')\n    c.me = c\n"
            "gc.disable()\nfor _ in range(5):\n    leak()\n"
            "t = threading.Thread(target=gc.collect, daemon=True)\nt.start()\nt.join(20)\n"
            "print('hung' if t.is_alive() else 'collected')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.stdout.strip() == "collected", out.stdout + out.stderr
