"""The engine's link threads: ticks arrive decoded and in order, answers leave in order with the
samples written first and memory figures added, and every way the link ends reaches the main loop."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from ipc import link
from ipc.link import EngineProcessConfig
from ipc.protocol import pack
from ipc.seqpacket import LinkSocket
from ipc.shm import TokenArena
from meshnode.core.types import Plan, SeqChunk, StepResult
from meshnode.dev.engines import FACTORY
from meshnode.worker.link_io import CLOSED, LinkIO
from meshnode.worker.main import EngineProcess


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    arena = TokenArena.create(link.arena_tokens(16))
    front, io = LinkSocket(a), LinkIO(LinkSocket(b), arena)
    io.start()
    yield front, io, arena
    io.close()
    front.close()
    arena.close()


def plan(t: int) -> Plan:
    return Plan([SeqChunk(0, t, np.array([t + 3], np.int32), t), SeqChunk(1, 0, np.array([4, 5], np.int32), 0)])


def test_ticks_arrive_decoded_in_order_and_answers_leave_in_order(pair):
    front, io, arena = pair
    for t in (1, 2):  # two in flight, as the pipelined front sends them
        front.send(link.encode(link.TickRequest(t, plan(t), fresh=t == 1), arena))
    for t in (1, 2):
        req = io.next(5)
        assert (req.tick, req.fresh) == (t, t == 1)
        assert [c.tokens.tolist() for c in req.plan.chunks] == [[t + 3], [4, 5]]
        io.done(t, StepResult({0: 100 + t, 1: 200 + t}, [], 1.0, 3), 0.5)
    for t in (1, 2):
        msg = link.decode(front.recv())
        assert (msg.tick, msg.result.step_ms, msg.result.kv_cells, msg.gap_ms) == (t, 1.0, 3, 0.5)
        assert msg.rss > 0 and msg.mem_total > 0  # the writer adds the memory figures
        assert msg.result.tokens == {0: 100 + t, 1: 200 + t}  # the sampled ids, in the answer


def test_a_tick_that_does_not_decode_is_handed_on_as_a_refusal_in_its_place(pair):
    front, io, arena = pair
    front.send(link.encode(link.TickRequest(1, plan(1)), arena))
    front.send(pack({"kind": "tick", "tick": 2, "seq": [0], "pos": [0], "offset": [10 ** 6], "n": [1], "draw": [0]}))
    front.send(link.encode(link.TickRequest(3, plan(1)), arena))
    got = [io.next(5) for _ in range(3)]
    assert [g.tick for g in got] == [1, 2, 3]
    assert isinstance(got[1], link.MalformedTick) and "outside the arena" in str(got[1])
    assert isinstance(got[0], link.TickRequest) and isinstance(got[2], link.TickRequest)


def test_nothing_yet_then_stop(pair):
    front, io, _ = pair
    assert io.next(0.05) is None  # nothing yet: the main loop gets its chance to check on the front
    front.send(link.encode(link.Stop()))
    assert io.next(5) == link.Stop()


def test_a_closed_link_reads_as_closed():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    io = LinkIO(LinkSocket(b), arena=None)
    io.start()
    a.close()
    assert io.next(5) == CLOSED
    io.close()


def test_a_message_that_is_not_msgpack_raises_in_the_main_thread():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    io = LinkIO(LinkSocket(b), arena=None)
    io.start()
    a.send(b"\xc1")  # never valid msgpack
    with pytest.raises(ValueError):
        io.next(5)
    io.close()
    a.close()


def test_a_failing_link_thread_is_raised_in_the_main_thread(pair):
    _, io, _ = pair
    io.refuse(link.TickRefused(1, False, object()))  # msgpack cannot pack it: the writer fails
    with pytest.raises(TypeError):
        io.next(5)


def test_the_engine_refuses_a_tick_that_did_not_decode_like_any_bad_plan():
    proc = EngineProcess(EngineProcessConfig("x", 0, "a", 1, 1, None, "INFO", 1, FACTORY, {"fake": {}}))
    answer = proc.run(link.MalformedTick(7, "chunk of sequence 0 points outside the arena"))
    assert answer == link.TickRefused(7, False, "chunk of sequence 0 points outside the arena")
    assert proc.followups.refusing  # the ticks queued behind it are refused until the front resyncs


def test_the_heartbeat_says_finished_only_once_the_answer_is_sent():
    """The front never calls a finished tick hung (core/health.py), so "finished" must mean the answer
    is on its way: an engine stopped after its step but before the send must still look unfinished."""
    import threading

    class HeldSocket:
        def __init__(self):
            self.entered, self.go, self.sent = threading.Event(), threading.Event(), []

        def send(self, data):
            self.entered.set()
            self.go.wait(30)
            self.sent.append(data)

    arena = TokenArena.create(link.arena_tokens(16))
    sock = HeldSocket()
    io = LinkIO(sock, arena)
    io._threads[1].start()  # the writer alone: nothing to read
    try:
        arena.beat(7, finished=False)
        io.refuse(link.TickRefused(7, False, "x"))
        assert sock.entered.wait(30)  # the writer is inside its send
        assert arena.heartbeat()[:2] == (7, 0) and not sock.sent  # stepped, not sent: not finished
        sock.go.set()
        deadline = time.monotonic() + 5
        while arena.heartbeat()[1] != 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert arena.heartbeat()[1] == 7 and len(sock.sent) == 1
    finally:
        io._outbox.put(None)
        io._threads[1].join(2)
        arena.close()
