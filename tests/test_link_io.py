"""The engine's link threads: ticks arrive decoded and in order, replies leave in order with the
samples written first and memory figures added, and every way the link ends reaches the main loop."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from ipc import link as L
from ipc.protocol import pack
from ipc.seqpacket import LinkSocket
from ipc.shm import TokenArena
from meshnode.worker.link_io import CLOSED, STOP, LinkIO, Tick
from meshnode.core.types import Plan, SeqChunk, StepResult
from meshnode.worker.main import EngineProcess


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    arena = TokenArena.create(*L.arena_shape(16, 4))
    front, io = LinkSocket(a), LinkIO(LinkSocket(b), arena)
    io.start()
    yield front, io, arena
    io.close()
    front.close()
    arena.close()


def plan(t: int) -> Plan:
    return Plan([SeqChunk(0, t, np.array([t + 3], np.int32), t), SeqChunk(1, 0, np.array([4, 5], np.int32), 0)])


def test_ticks_arrive_decoded_in_order_and_replies_leave_in_order(pair):
    front, io, arena = pair
    for t in (1, 2):  # two in flight, as the pipelined front sends them
        front.send(L.encode_tick(t, plan(t), arena, fresh=t == 1))
    for t in (1, 2):
        tick = io.next(5)
        assert (tick.t, tick.fresh, tick.error) == (t, t == 1, "")
        assert [c.tokens.tolist() for c in tick.plan.chunks] == [[t + 3], [4, 5]]
        res = StepResult({0: 100 + t, 1: 200 + t})
        io.reply(L.tick_ok(t, [], 1.0, 3, 0.5), (tick.out, tick.plan, res))
    for t in (1, 2):
        msg = L.unpack_message(front.recv())
        assert msg["t"] == t and msg["gap_ms"] == 0.5
        assert msg["rss"] > 0 and len(msg["mem"]) == 2  # the writer adds the memory figures
        assert L.read_result(msg, plan(t), arena, n_vocab=512).tokens == {0: 100 + t, 1: 200 + t}


def test_a_tick_that_does_not_decode_is_handed_on_as_an_error_in_its_place(pair):
    front, io, arena = pair
    front.send(L.encode_tick(1, plan(1), arena))
    front.send(pack({"t": 2, "seqs": [[0, 0, 10 ** 6, 1, 0]], "out": 0}))
    front.send(L.encode_tick(3, plan(1), arena))
    got = [io.next(5) for _ in range(3)]
    assert [g.t for g in got] == [1, 2, 3]
    assert got[1].plan is None and "outside the arena" in got[1].error
    assert not got[0].error and not got[2].error


def test_nothing_yet_then_stop(pair):
    front, io, _ = pair
    assert io.next(0.05) is None  # nothing yet: the main loop gets its chance to check on the front
    front.send(L.STOP)
    assert io.next(5) == STOP


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
    with pytest.raises(ValueError, match="malformed engine-link message"):
        io.next(5)
    io.close()
    a.close()


def test_a_failing_link_thread_is_raised_in_the_main_thread(pair):
    _, io, _ = pair
    io.reply({"t": 1, "bad": object()})  # msgpack cannot pack it: the writer fails
    with pytest.raises(TypeError):
        io.next(5)


def test_the_engine_refuses_a_tick_that_did_not_decode_like_any_bad_plan():
    proc = EngineProcess({"parent_pid": 0})
    reply, samples = proc.tick(Tick(7, None, error="tick entry points outside the arena"))
    assert reply == L.tick_failed(7, False, "tick entry points outside the arena") and samples is None
    assert proc.chain.refusing  # the ticks queued behind it are refused until the front resyncs
