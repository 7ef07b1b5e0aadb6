"""A drain that hands over (`--handoff`): live sessions go to a peer node with their KV, and their clients'
streams go on through the draining node until they end there (front/handoff.py)."""
import signal
import tempfile

from meshnode.core import reasons as R
from meshnode.core.types import Sampling
from meshnode.dev.hostile import mesh_key
from meshnode.dev.nodeproc import NodeProcess

SLOW = {"faults": [{"step_sleep_s": 0.03}]}  # a tick takes 30 ms: the sessions still run when the drain comes
# one thread: several nodes at once; one mesh key: the peer loads the KV the draining node hands it
ARGS = ("--deterministic", "--decode-steps-ms", "0", "--threads", "1", "--mesh-key-file", mesh_key(tempfile.mkdtemp()))
PROMPT = [3 + (k * 23) % 500 for k in range(41)]
ASKS = {"a": dict(tokens=PROMPT, max_tokens=200, ignore_eos=True, sampling=Sampling(0.9, 40, 0.95, 3), logprobs=1),
        "b": dict(tokens=PROMPT[:20], max_tokens=150, ignore_eos=True)}


def _drain_with_sessions_running(node, c):
    for sid, ask in ASKS.items():
        c.submit(sid, **ask)
    for sid in ASKS:
        c.wait_for(lambda e: e["event"] == "tokens" and e["id"] == sid, keep=True)
    node.proc.send_signal(signal.SIGTERM)
    return c.collect(list(ASKS))


def test_sessions_live_at_a_drain_finish_on_the_peer_and_their_streams_go_on(tiny_model):
    with NodeProcess(tiny_model, *ARGS) as peer, peer.client() as cp:
        want = {sid: cp.generate(f"ref-{sid}", **ask) for sid, ask in ASKS.items()}
        with NodeProcess(tiny_model, *ARGS, "--handoff", peer.listen, internal=SLOW) as node, node.client() as c:
            got = _drain_with_sessions_running(node, c)
            assert node.proc.wait(60) == 0
            assert "handoff" not in node.log()  # nothing refused, nothing malformed
    for sid, r in got.items():
        ref = want[sid]
        assert r.admission["event"] == "admitted" and r.done["reason"] == R.LENGTH, r.done
        assert r.tokens == r.done["tokens"] == ref.done["tokens"]  # bitwise, every token once
        assert "".join(e["text"] for e in r.events) == r.done["text"] == ref.done["text"]
        assert [e["event"] for e in r.events].count("admitted") == 0  # one admitted, at the start (r.admission)


def test_a_peer_that_refuses_leaves_the_sessions_to_end_drained_with_their_tokens(tiny_model):
    with NodeProcess(tiny_model, "--no-deterministic", "--threads", "1") as other:  # another recipe: refuses imports
        with NodeProcess(tiny_model, *ARGS, "--handoff", other.listen, internal=SLOW) as node, node.client() as c:
            got = _drain_with_sessions_running(node, c)
            assert node.proc.wait(60) == 0
            log = node.log()
    for r in got.values():
        assert r.done["reason"] == R.DRAINED and "REJECTED_RECIPE_MISMATCH" in r.done["detail"]
        assert r.tokens == r.done["tokens"] and 1 <= len(r.tokens) < 150
        assert "".join(e["text"] for e in r.events) == r.done["text"]
    assert "handoff:" in log


def test_at_the_drain_deadline_the_peer_stops_what_it_carries_and_every_client_gets_one_done(tiny_model):
    with NodeProcess(tiny_model, *ARGS, internal=SLOW) as peer:  # the peer is slow too: it cannot finish in time
        with NodeProcess(tiny_model, *ARGS, "--handoff", peer.listen, "--drain-timeout-s", "1",
                         internal=SLOW) as node, node.client() as c:
            got = _drain_with_sessions_running(node, c)
            assert node.proc.wait(60) == 0
    for r in got.values():
        assert r.done["reason"] == R.DRAINED and r.tokens == r.done["tokens"] and len(r.tokens) < 150
        assert "".join(e["text"] for e in r.events) == r.done["text"]


def test_a_peer_that_never_answers_leaves_every_session_one_done_at_the_deadline(tiny_model, tmp_path):
    nobody = f"ipc://{tmp_path}/nobody.sock"  # no node listens there: the imports wait in the socket
    with NodeProcess(tiny_model, *ARGS, "--handoff", nobody, "--drain-timeout-s", "1", internal=SLOW) as node, \
            node.client() as c:
        got = _drain_with_sessions_running(node, c)
        assert node.proc.wait(60) == 0
    for r in got.values():
        assert r.done["reason"] == R.DRAINED and r.tokens == r.done["tokens"] and len(r.tokens) < 150
        assert "".join(e["text"] for e in r.events) == r.done["text"]


# -- a hostile peer: each session's import is answered by one misbehaviour ------------------------------------
HOSTILE = {  # name -> the events the peer sends for that import (after which it says nothing more)
    "done without reason": [{"event": "admitted"}, {"event": "done", "tokens": [], "text": "", "usage": {}}],
    "rejected without detail": [{"event": "rejected", "reason": "REJECTED_QUEUE_FULL"}],
    "a token past the vocabulary": [{"event": "admitted"}, {"event": "tokens", "tokens": [10**6], "text": "x"}],
    "a string token": [{"event": "admitted"}, {"event": "tokens", "tokens": ["7"], "text": "x"}],
    "a float token": [{"event": "admitted"}, {"event": "tokens", "tokens": [7.5], "text": "x"}],
    "a negative token in done": [{"event": "admitted"},
                                 {"event": "done", "reason": "LENGTH", "tokens": [-3], "text": "", "usage": {}}],
    "an unknown reason": [{"event": "admitted"},
                          {"event": "done", "reason": "PWNED", "tokens": [], "text": "", "usage": {}}],
    "bad logprobs": [{"event": "admitted"}, {"event": "tokens", "tokens": [7], "text": "x", "logprobs": [{"a": 1}]}],
    "text not a string": [{"event": "admitted"}, {"event": "tokens", "tokens": [7], "text": b"\xff"}],
    "tokens a map": [{"event": "admitted"}, {"event": "tokens", "tokens": {"0": 7}, "text": "x"}],
    "a bool token": [{"event": "admitted"}, {"event": "tokens", "tokens": [True], "text": "x"}],
    "usage not a map": [{"event": "admitted"},
                        {"event": "done", "reason": "LENGTH", "tokens": [], "text": "", "usage": [1, 2]}],
    "an infinite usage": [{"event": "admitted"}, {"event": "done", "reason": "LENGTH", "tokens": [], "text": "",
                                                  "usage": {"total_ms": float("inf")}}],
    "error without a code": [{"event": "error", "detail": "x"}],
    "a huge token list": [{"event": "admitted"}, {"event": "tokens", "tokens": [7] * 60_000 + ["x"], "text": "x"}],
    "silence after admitted": [{"event": "admitted"}],  # never a done: the drain's deadline ends it here
}


def _hostile_peer(endpoint: str, stop):
    """A ROUTER that answers the n-th import with HOSTILE's n-th behaviour (and another client's id beside it)."""
    import zmq

    from ipc import protocol as P

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    behaviours, n = list(HOSTILE.values()), 0
    try:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            ident, *frames = sock.recv_multipart()
            req = P.unpack(frames[1])
            if req.get("op") != "import" or n >= len(behaviours):
                continue
            sock.send_multipart([ident, P.VERSION, P.pack({"event": "tokens", "id": "someone-else", "tokens": [1],
                                                           "text": "?"})])
            for ev in behaviours[n]:
                sock.send_multipart([ident, P.VERSION, P.pack({**ev, "id": req["id"]})])
            n += 1
    finally:
        sock.close(0)
        ctx.term()


def test_a_hostile_peer_leaves_every_client_one_done_and_the_node_exits_0(tiny_model, tmp_path):
    import threading

    endpoint, stop = f"ipc://{tmp_path}/peer.sock", threading.Event()
    peer = threading.Thread(target=_hostile_peer, args=(endpoint, stop), daemon=True)
    peer.start()
    asks = {f"s{i}": dict(tokens=PROMPT[:10 + i], max_tokens=1000, ignore_eos=True) for i in range(len(HOSTILE))}
    try:
        with NodeProcess(tiny_model, *ARGS, "--n-seq-max", str(len(HOSTILE)), "--ctx", str(2048 * len(HOSTILE)),
                         "--handoff", endpoint, "--drain-timeout-s", "2", internal=SLOW) as node, \
                node.client() as c:
            for sid, ask in asks.items():
                c.submit(sid, **ask)
            for sid in asks:
                c.wait_for(lambda e: e["event"] == "tokens" and e["id"] == sid, keep=True)
            node.proc.send_signal(signal.SIGTERM)
            got = c.collect(list(asks))
            assert node.proc.wait(60) == 0
            log = node.log()
    finally:
        stop.set()
        peer.join(10)
    for sid, r in got.items():
        assert r.done["reason"] == R.DRAINED, (sid, r.done)
        assert all(0 <= t < 512 and type(t) is int for t in r.done["tokens"])
        assert r.tokens == r.done["tokens"][:len(r.tokens)]
    assert log.count("malformed") >= len(HOSTILE) - 2, log  # all but the silent one and the rejected one
