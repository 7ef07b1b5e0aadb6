"""The engine link: its messages (ipc/link.py) and its socket (ipc/seqpacket.py)."""
import os
import select
import socket

import numpy as np
import pytest

from ipc import link, seqpacket
from ipc.protocol import pack
from meshnode.dev.engines import FACTORY
from ipc.shm import TokenArena
from meshnode.core.types import Constrained, EngineInfo, Grammar, Logprob, Plan, Sampling, SeqChunk, StepResult


@pytest.fixture
def arena():
    a = TokenArena.create(link.arena_tokens(16))
    yield a
    a.close()


def plan():
    return Plan([SeqChunk(0, 0, np.array([5, 6, 7], np.int32), 0, Sampling(0.5, 3, 0.9, 11)),
                 SeqChunk(2, 9, np.array([-1], np.int32), 4, follow=True)], release=[1])


def test_a_tick_round_trips_and_consecutive_ticks_use_separate_halves(arena):
    for t in (7, 8):
        got = link.decode(link.encode(link.TickRequest(t, plan(), resync=t == 8), arena), arena)
        assert got.tick == t and got.resync == (t == 8) and got.plan.release == [1]
        assert [(c.seq_id, c.pos, c.tokens.tolist(), c.draw, c.follow) for c in got.plan.chunks] == \
            [(0, 0, [5, 6, 7], 0, False), (2, 9, [-1], 4, True)]
        assert got.plan.chunks[0].sampling == Sampling(0.5, 3, 0.9, 11) and got.plan.chunks[1].sampling is None
    # tick 8 did not overwrite tick 7's tokens: two ticks can be in flight
    assert arena.input[:3].tolist() == [5, 6, 7] and arena.input[16:19].tolist() == [5, 6, 7]


def test_a_grammar_crosses_once_per_incarnation_and_ticks_name_it_by_key(arena):
    """Eight new sessions on one schema cost one GrammarText, not eight copies in the tick; a tick naming
    a grammar the engine was not sent is refused in its place; the least recently named are forgotten."""
    g, h = Grammar("k1", "x" * 100_000), Grammar("k2", "y")
    chunks = [SeqChunk(s, 0, np.array([5], np.int32), 0, constraint=Constrained(g, 1)) for s in range(3)]
    sent = link.GrammarsSent(keep=1)
    ahead = sent.ahead_of(Plan(chunks))
    assert ahead == [link.GrammarText(g)] and sent.ahead_of(Plan(chunks)) == []
    data = link.encode(link.TickRequest(1, Plan(chunks)), arena)
    assert len(data) < 1000
    with pytest.raises(link.MalformedTick, match="not sent"):
        link.decode(data, arena, {})
    store = {}
    got = link.decode(link.encode(ahead[0]), arena)
    store[got.grammar.key] = got.grammar
    tick = link.decode(data, arena, store)
    assert [c.constraint for c in tick.plan.chunks] == [Constrained(g, 1)] * 3
    assert tick.plan.chunks[0].constraint.grammar.text == g.text
    assert sent.ahead_of(Plan([SeqChunk(4, 0, np.array([5], np.int32), 0, constraint=Constrained(h, 1))])) == \
        [link.GrammarText(h, forget=("k1",))]


@pytest.mark.parametrize("msg", [link.Stop(), link.GrammarText(Grammar("k", "g"), ("old",)), link.HelloFailed("no model"), link.Aborted("GGML_ASSERT(x) failed"),
                                 link.TickDone(3, StepResult({0: 17, 5: 0}, [1], 2.5, 40,
                                                             {2: Logprob(-0.5, ((7, -0.5), (9, -1.5)))}, 3, 1,
                                                             {4: "no token may come next"}), 0.1, 1 << 20, 5, 9),
                                 link.TickRefused(4, True, "rc=-3"),
                                 link.Hello(17, EngineInfo(512, 2, (2, 5), 8, 4096, 4096, 512, 2048, 10, "mn1-x"))])
def test_every_other_message_round_trips_typed(msg):
    assert link.decode(link.encode(msg)) == msg


@pytest.mark.parametrize("bad", [64, -1])
def test_a_sample_outside_the_vocabulary_is_refused_not_passed_on(bad):
    with pytest.raises(ValueError, match=f"token {bad} for sequence 2, outside the vocabulary of 64"):
        link.check_samples({0: 40, 2: bad}, plan(), n_vocab=64)


@pytest.mark.parametrize("tokens", [{0: 40}, {0: 40, 2: 41, 3: 42}, {}])
def test_samples_for_other_sequences_than_the_ticks_are_refused(tokens):
    """A token for each sampling chunk and no other: a missing or a stray one means a broken engine."""
    with pytest.raises(ValueError, match="engine sampled for sequences"):
        link.check_samples(tokens, plan(), n_vocab=64)
    link.check_samples({0: 40}, plan(), n_vocab=64, absent={2})  # a cache miss draws none


def tick_map(**fields):
    return pack({"kind": "tick", "tick": 1, "release": [], "seq": [0], "pos": [0], "offset": [0], "n": [1],
                 "draw": [0], "sampling": [], "follow": [], **fields})


@pytest.mark.parametrize("fields, words", [
    ({"offset": [30], "n": [5]}, "outside the arena"),
    ({"n": [1.5]}, "not a list of integers"),
    ({"seq": [0, 1]}, "differ in length"),
    ({"follow": ["x"]}, "follow"),
    ({"sampling": [{"seq": 0, "temperature": 1}]}, "sampling"),
])
def test_malformed_ticks_are_refused_with_a_reason_and_their_number(arena, fields, words):
    with pytest.raises(link.MalformedTick, match=words) as e:
        link.decode(tick_map(**fields), arena)
    assert e.value.tick == 1


@pytest.mark.parametrize("data, words", [(pack([1, 2]), "not a map"), (pack({"kind": "launch"}), "unknown"),
                                         (pack({"kind": "done", "tick": 1}), "malformed")])
def test_other_malformed_messages_are_value_errors(data, words):
    with pytest.raises(ValueError, match=words):
        link.decode(data)


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
    assert select.select([front.sock], [], [], 30)[0] and bytes(front.recv()) == b"hello"
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
    from meshnode.core.health import EngineHealth
    from meshnode.front.engine_link import EngineLink

    engine_link = EngineLink(str(tmp_path), arena, EngineHealth(5.0, 300.0, 10.0),
                             engine=None, n_vocab=512, model_path="m.gguf", log_level="INFO", rpc_timeout_s=2.0,
                             factory=FACTORY, factory_args={"fake": {}})
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    engine_link.sock = seqpacket.LinkSocket(a)
    b.send(b"\xc1")  # never valid msgpack
    assert engine_link.receive() is None
    assert "engine sent a malformed message" in engine_link.broken
    a.close()
    b.close()


def test_a_tick_is_stamped_sent_once_it_is_sent_so_a_paused_front_is_not_a_hung_engine(arena, tmp_path, monkeypatch):
    """A front stopped (SIGSTOP, a busy machine) just before its send must not count the pause against the
    engine: the hang rule measures from `sent_at` (once: test_stall's stopped-front test failed 1 of 14)."""
    from meshnode.core.health import EngineHealth
    from meshnode.core.pipeline import Tick
    from meshnode.core.types import Plan
    from meshnode.front import engine_link as el, ticks as tk

    clock = [100.0]
    monkeypatch.setattr(tk.time, "monotonic", lambda: clock[0])
    link = el.EngineLink(str(tmp_path), arena, EngineHealth(0.5, 300.0, 10.0),
                         engine=None, n_vocab=512, model_path="m.gguf", log_level="INFO", rpc_timeout_s=2.0,
                         factory=FACTORY, factory_args={"fake": {}})
    ticks = tk.Ticks(link, 2, None)

    class Paused:  # the front stops for 1.5 s inside the send
        def send(self, data):
            clock[0] += 1.5

    link.sock = Paused()
    tick = Tick(0, Plan([]))
    ticks.send(tick)
    assert tick.sent_at == clock[0]
    assert link.health.hung(clock[0], [tick], lambda: (0, 0, 99.0)) == ""  # the engine has had it 0 s


def test_deaths_while_loading_an_import_restart_the_engine_but_never_make_a_crash_loop():
    """Six hostile imports sent as each restarted engine came up stopped the node for good (5 deaths)."""
    from meshnode.core.health import CRASH_LOOP_DEATHS, EngineHealth

    h = EngineHealth(30.0, 300.0, 10.0)
    h.ready(0.0)
    for k in range(3 * CRASH_LOOP_DEATHS):
        h.died(float(k), "GGML_ASSERT", counted=False)
        assert h.healthy and h.restart_due(float(k) + 60)
        h.starting(float(k) + 60)
        h.ready(float(k) + 61)
    for k in range(CRASH_LOOP_DEATHS):  # the deaths nobody's input explains still count
        h.died(1000.0 + k, "segfault")
        if h.healthy:
            h.restart_due(2000.0 + k)
    assert not h.healthy
