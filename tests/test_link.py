"""The engine link: its messages (ipc/link.py) and its socket (ipc/seqpacket.py)."""
import os
import socket

import numpy as np
import pytest

from ipc import link as L
from ipc import seqpacket
from ipc.shm import TokenArena
from meshnode.core.types import Plan, Sampling, SeqChunk, StepResult


@pytest.fixture
def arena():
    a = TokenArena.create(*L.arena_shape(16, 4))
    yield a
    a.close()


def plan():
    return Plan([SeqChunk(0, 0, np.array([5, 6, 7], np.int32), 0, Sampling(0.5, 3, 0.9, 11)),
                 SeqChunk(2, 9, np.array([-1], np.int32), 4, follow=True)], release=[1])


def test_a_tick_round_trips_and_consecutive_ticks_use_separate_halves(arena):
    for t in (7, 8):
        got, out, resync = L.decode_tick(L.unpack_message(L.encode_tick(t, plan(), arena, resync=t == 8)), arena)
        assert resync == (t == 8) and got.release == [1]
        assert [(c.seq_id, c.pos, c.tokens.tolist(), c.draw, c.follow) for c in got.chunks] == \
            [(0, 0, [5, 6, 7], 0, False), (2, 9, [-1], 4, True)]
        assert got.chunks[0].sampling == Sampling(0.5, 3, 0.9, 11) and got.chunks[1].sampling is None
        L.write_samples(arena, out, got, StepResult({0: 40, 2: 41}))
    # tick 8 did not overwrite tick 7's tokens or samples: two ticks can be in flight
    assert L.read_result({"t": 7}, plan(), arena, n_vocab=64).tokens == {0: 40, 2: 41}
    assert arena.input[:3].tolist() == [5, 6, 7] and arena.input[16:19].tolist() == [5, 6, 7]


@pytest.mark.parametrize("bad", [64, -1])
def test_a_sample_outside_the_vocabulary_is_refused_not_passed_on(arena, bad):
    got, out, _ = L.decode_tick(L.unpack_message(L.encode_tick(7, plan(), arena)), arena)
    L.write_samples(arena, out, got, StepResult({0: 40, 2: bad}))
    with pytest.raises(ValueError, match=f"token {bad} for sequence 2, outside the vocabulary of 64"):
        L.read_result({"t": 7}, plan(), arena, n_vocab=64)


@pytest.mark.parametrize("msg, words", [
    ({"t": 1, "seqs": [[0, 0, 30, 5, 0]]}, "outside the arena"),
    ({"t": 1, "seqs": [[0, 0, 0, 1.5, 0]]}, "malformed"),
    ({"t": 1, "seqs": [[0, 0, 0, 1, 0]], "out": 8}, "output base"),
    ({"t": 1, "seqs": [], "follow": ["x"]}, "follow"),
    ({"t": 1, "seqs": "no"}, "seqs"),
])
def test_malformed_ticks_are_refused_with_a_reason(arena, msg, words):
    with pytest.raises(ValueError, match=words):
        L.decode_tick(msg, arena)


def test_the_link_accepts_only_the_process_it_spawned(tmp_path):
    path = str(tmp_path / "engine.sock")
    listener = seqpacket.listen(path)
    stranger = seqpacket.connect(path)
    assert seqpacket.accept(listener, pid=os.getpid() + 1) is None  # not the engine: closed
    assert stranger.recv() is None
    engine = seqpacket.connect(path)
    front = seqpacket.accept(listener, pid=os.getpid())
    assert front is not None
    engine.send(b"hello")
    assert front.poll(1.0) and bytes(front.recv()) == b"hello"
    front.send(b"tick")
    assert bytes(engine.recv()) == b"tick"
    engine.close()
    assert front.recv() is None  # a closed link reads as None, not an exception
    front.close()
    listener.close()


def test_an_oversize_message_is_refused_before_it_is_sent():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with pytest.raises(ValueError, match="exceeds"):
        seqpacket.LinkSocket(a).send(b"x" * (seqpacket.MAX_MESSAGE + 1))
    a.close()
    b.close()


def test_a_reply_that_is_not_msgpack_marks_the_link_broken_instead_of_raising(arena, tmp_path):
    from meshnode.front.engine_link import EngineLink

    link = EngineLink(str(tmp_path), {}, arena, tick_deadline_s=5.0)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link.sock = seqpacket.LinkSocket(a)
    b.send(b"\xc1")  # never valid msgpack
    assert link.on_message() is None
    assert "engine sent a malformed message" in link.broken
    a.close()
    b.close()
