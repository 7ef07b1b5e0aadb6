"""What routers get from the node: the prefix cache's KV events (a replay predicts every hit and miss) and
the priority policy (order, displacement, fairness). Pure: the scheduler over the fake engine."""
import pytest

from helpers import Pipelined, prompt, run_to_completion, scheduler, step
from ipc import protocol as P
from ipc import events as E
from meshnode.core import reasons as R
from meshnode.core.kvevents import BLOCK_TOKENS, block_hashes
from meshnode.core.session import Session
from meshnode.dev.fake import FakeEngine
from meshnode.ops.config import NodeConfig


def replay(events, held=None) -> set:
    """What a router rebuilds from the events: the block hashes the node holds."""
    held = set() if held is None else held
    for ev in events:
        if ev[0] == "BlockStored":
            _, hashes, parent, ids, size, lora, medium = ev
            assert size == BLOCK_TOKENS and len(ids) == size * len(hashes) and lora is None
            assert parent is None or parent in held  # a chain is announced from a block whose parent is held
            assert block_hashes(ids[:size], None)[0] == hashes[0] or parent is not None
            held.update(hashes)
        elif ev[0] == "BlockRemoved":
            assert set(ev[1]) <= held
            held.difference_update(ev[1])
        else:
            assert ev == ["AllBlocksCleared"]
            held.clear()
    return held


def predicted_hit(held: set, tokens: list[int]) -> bool:
    """A router's rule: the prompt's first block is held (MIN_SHARE = one block is the least reused)."""
    hashes = block_hashes(tokens)
    return bool(hashes) and hashes[0] in held


def test_a_replay_of_the_kv_events_predicts_which_prompt_gets_a_cache_hit():
    """Conversations sharing a system prompt, next turns, strangers, evictions and a restart: before each
    submit the replayed events say hit or miss, and the session's reused tokens agree every time."""
    engine, sched = scheduler(prefix_cache="node", kv_events=True, max_active=2, max_batch_size=2)
    system = prompt(40, salt=7)
    held, checked = set(), []

    def run(tokens, key):
        nonlocal held, engine
        held = replay(sched.kv_events(), held)
        want = predicted_hit(held, tokens)
        s = Session(key, tokens, 6, ignore_eos=True)
        assert sched.submit(s).accepted
        run_to_completion(sched, engine)
        checked.append((key, want, s.n_reused))
        assert (s.n_reused > 0) == want, (key, want, s.n_reused)
        return s

    first = run(system + prompt(10, salt=1), "a1")
    run(system + prompt(12, salt=2), "b1")  # the system prompt's blocks are held: a hit
    run(first.tokens + prompt(9, salt=3), "a2")  # the next turn of a: all of a's blocks
    run(prompt(50, salt=99), "stranger")  # nothing of it held: a miss
    for i in range(10):  # more conversations than sequence slots: the oldest entries are evicted
        run(prompt(30 + i, salt=200 + i), f"x{i}")
    run(system + prompt(5, salt=4), "c1")  # a miss now: every entry holding the system prompt was evicted
    sched.engine_restarted()
    engine = FakeEngine(n_seq_max=8, n_ctx=4096)  # a new engine process: its KV starts empty
    held = replay(sched.kv_events(), held)
    assert held == set() == sched.cached_blocks()
    run(prompt(30 + 9, salt=209), "after-restart")  # held before the restart, cleared with it: a miss
    assert [w for _, w, _ in checked].count(True) >= 2 and [w for _, w, _ in checked].count(False) >= 3
    assert replay(sched.kv_events(), held) == sched.cached_blocks()  # the status answer's hashes


def test_blocks_shared_by_two_entries_stay_announced_until_both_are_gone():
    engine, sched = scheduler(prefix_cache="node", kv_events=True)
    system = prompt(48, salt=5)
    a, b = Session("a", system + prompt(8, salt=1), 3), Session("b", system + prompt(8, salt=2), 3)
    for s in (a, b):
        assert sched.submit(s).accepted
        run_to_completion(sched, engine)
    held = replay(sched.kv_events())
    shared = block_hashes(system)
    assert set(shared) <= held
    for seq in (a.seq_id, b.seq_id):
        assert sched.seqs.cache.forget(seq)
        held = replay(sched.kv_events(), held)
        assert (set(shared) <= held) == (seq == a.seq_id)  # still held by b after a went; gone with b


def test_the_hash_is_the_documented_chain():
    import hashlib

    ids = list(range(3, 3 + 2 * BLOCK_TOKENS + 5))
    h0 = int.from_bytes(hashlib.sha256(bytes(8) + b"".join(t.to_bytes(4, "little") for t in ids[:16])).digest()[:8],
                        "little", signed=True)
    h1 = int.from_bytes(hashlib.sha256(h0.to_bytes(8, "little", signed=True) + b"".join(
        t.to_bytes(4, "little") for t in ids[16:32])).digest()[:8], "little", signed=True)
    assert block_hashes(ids) == [h0, h1]  # the partial third block is not a block
    many = block_hashes(list(range(16 * 64)))
    assert any(h < 0 for h in many) and all(-2**63 <= h < 2**63 for h in many)  # i64, as Dynamo keys them


def queued(sched):
    return [s.key for s in sched.waiting]


def test_the_priority_policy_orders_the_queue_by_priority_then_arrival():
    engine, sched = scheduler(policy="priority", max_active=1, max_queue=8)
    assert sched.submit(Session("run", prompt(4), 3)).reason == R.ADMITTED
    for key, p in (("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)):
        assert sched.submit(Session(key, prompt(4), 3, priority=p)).reason == R.QUEUED
    assert queued(sched) == ["d", "b", "e", "a", "c"]  # lower first; within a priority, arrival
    ended = [ev.session for ev in run_to_completion(sched, engine) if ev.kind == "done"]
    # d (better than the running one) preempted it; it went back first in its class, and lost nothing
    assert [s.key for s in ended] == ["d", "run", "b", "e", "a", "c"] and sched.counters.preemptions == 1
    assert all(engine.expected(s.tokens, len(s.prompt)) and s.reason == R.LENGTH for s in ended)


def streamed(events, key) -> list[int]:
    return [t for ev in events if ev.kind == "tokens" and ev.session.key == key for t in ev.tokens]


def generating_low(depth: int):
    """One slot, a low-priority session 5 tokens into its generation with `depth` ticks in flight at most:
    (engine, scheduler, driver, the session, the events so far)."""
    # a token a tick; no prefix cache, so a preempted session re-prefills all of it on its old sequence
    engine, sched = scheduler(policy="priority", max_active=1, max_queue=4, steps_ms=0.0, prefix_cache="off")
    driver = Pipelined(sched, engine, depth=depth)
    low = Session("low", prompt(6), 20, priority=3)
    sched.submit(low)
    events = []
    while low.n_generated < 5:
        driver.fill()
        events += driver.run_one()
    return engine, sched, driver, low, events


@pytest.mark.parametrize("depth", [1, 2])
def test_a_better_request_preempts_a_generating_one_which_goes_on_where_it_was_each_token_once(depth):
    """With ticks in flight (depth 2) the preempted session's samples still on their way are stale: they
    are dropped, not streamed, and drawn again after its re-prefill, the same tokens a cold run draws."""
    engine, sched, driver, low, events = generating_low(depth)
    started = low.t_start
    assert sched.submit(Session("high", prompt(5, salt=1), 8, priority=-1)).reason == R.QUEUED
    events += driver.run_to_completion()
    ends = [ev.session.key for ev in events if ev.kind == "done"]
    assert ends == ["high", "low"] and sched.counters.preemptions == 1
    assert low.reason == R.LENGTH and engine.expected(low.tokens, len(low.prompt))
    assert streamed(events, "low") == low.generated  # each token streamed once, in order
    assert low.t_start == started  # its queue time is its first wait, not the wait after the preemption


def test_a_preempted_session_back_on_its_old_sequence_ignores_the_ticks_it_had_in_flight():
    """Three ticks in flight (the driver allows it, the node runs two): the preempting session is cancelled
    at once, the preempted one starts again on its old sequence id while a tick planned for it before is
    still on its way; that tick's answer is stale and must not be taken as its own."""
    engine, sched, driver, low, events = generating_low(3)
    old_seq = low.seq_id
    sched.submit(Session("high", prompt(5, salt=1), 8, priority=-1))
    driver.fill()  # planned: low preempted, high's prompt; two ticks of low's still in flight
    assert sched.counters.preemptions == 1 and len(driver.sent) == 3
    events.append(sched.cancel("high"))
    events += driver.run_one()
    driver.fill()
    assert low.state == "RUNNING" and low.seq_id == old_seq and driver.sent  # back, with a stale tick ahead
    events += driver.run_to_completion()
    assert low.reason == R.LENGTH and engine.expected(low.tokens, len(low.prompt))
    assert streamed(events, "low") == low.generated


def test_no_session_is_preempted_in_vain_nor_for_an_equal_or_worse_priority():
    engine, sched = scheduler(policy="priority", max_active=2, max_queue=4)
    kv = sched.budget.kv_budget_bytes // sched.budget.kv_bytes_per_token
    a = Session("a", prompt(4), 10, priority=2)
    b = Session("b", prompt(4), 10, priority=0)
    for s in (a, b):
        sched.submit(s)
    step(sched, engine, sched.plan())
    # needs more KV than preempting `a` (the only worse one) frees: it waits, and nobody is preempted
    huge = Session("huge", prompt(4), kv - 4 - 14 + 1, priority=1)
    assert sched.submit(huge).reason == R.QUEUED
    same = Session("same", prompt(4), 10, priority=2)
    sched.submit(same)
    step(sched, engine, sched.plan())
    assert sched.counters.preemptions == 0 and [s.key for s in sched.running] == ["a", "b"]


def test_a_preempted_session_is_never_displaced_from_the_queue():
    engine, sched = scheduler(policy="priority", max_active=1, max_queue=1, steps_ms=0.0)  # a token a tick
    low = Session("low", prompt(4), 10, priority=3)
    sched.submit(low)
    for _ in range(3):
        step(sched, engine, sched.plan())
    sched.submit(Session("high", prompt(4), 5, priority=0))
    step(sched, engine, sched.plan())  # high starts in low's place; low waits with 3 tokens streamed
    assert [s.key for s in sched.waiting] == ["low"] and low.n_generated == 3
    later = sched.submit(Session("later", prompt(4), 5, priority=-5))
    assert later.reason == R.REJECTED_QUEUE_FULL and not later.displaced
    run_to_completion(sched, engine)
    assert low.reason == R.LENGTH and engine.expected(low.tokens, len(low.prompt))


def test_a_better_request_displaces_the_worst_queued_one_which_gets_its_done():
    engine, sched = scheduler(policy="priority", max_active=1, max_queue=2)
    sched.submit(Session("run", prompt(4), 3))
    for key in ("a", "c"):
        sched.submit(Session(key, prompt(4), 3, priority=5))
    same = sched.submit(Session("f", prompt(4), 3, priority=5))  # not better than the worst: refused as ever
    assert same.reason == R.REJECTED_QUEUE_FULL and not same.displaced
    d = sched.submit(Session("e", prompt(4), 3, priority=1))
    assert d.reason == R.QUEUED and queued(sched) == ["e", "a"]
    [ev] = d.displaced  # the latest of the worst priority gives way; the earlier one keeps its place
    assert (ev.kind, ev.session.key, ev.reason) == ("done", "c", R.REJECTED_QUEUE_FULL)
    assert "priority 1" in ev.detail and "c" not in sched.live
    assert sched.submit(Session("g", prompt(4), 3, priority=9)).reason == R.REJECTED_QUEUE_FULL
    assert sched.precheck(Session("h", prompt(4), 3, priority=0).ask).reason == R.QUEUED  # before tokenizing too
    ends = {ev.session.key: ev.reason for ev in run_to_completion(sched, engine) if ev.kind == "done"}
    assert ends == {"run": R.LENGTH, "e": R.LENGTH, "a": R.LENGTH}


def test_first_come_first_served_refuses_a_priority_it_would_not_honour():
    _, sched = scheduler(max_active=1)
    d = sched.submit(Session("p", prompt(4), 3, priority=-5))
    assert d.reason == R.REJECTED_BAD_REQUEST and "--scheduling-policy priority" in d.detail
    assert sched.submit(Session("z", prompt(4), 3, priority=0)).accepted


@pytest.mark.parametrize("value, ok", [(0, True), (-7, True), (P.PRIORITY_RANGE, True), (P.PRIORITY_RANGE + 1, False),
                                       (1.5, False), (True, False), ("1", False)])
def test_priority_on_the_wire(value, ok):
    frames = [P.VERSION, P.pack({"op": "submit", "id": "x", "tokens": [3], "max_tokens": 2, "priority": value})]
    if ok:
        assert P.decode_request(frames, n_vocab=64).priority == value
        assert P.decode_request(P.encode_request(P.Submit("x", 2, [3], priority=value)), n_vocab=64).priority == value
    else:
        with pytest.raises(P.ProtocolError, match="priority must be an int"):
            P.decode_request(frames, n_vocab=64)



@pytest.mark.slow
def test_a_router_following_the_nodes_kv_events_predicts_its_hits_and_the_status_agrees(tiny_model, tmp_path):
    """The PUB stream as a router reads it (vLLM's frames: topic, 8-byte sequence, msgpack
    [ts, events, data_parallel_rank]), replayed before each request: the prediction matches each done's
    cached_tokens, and the status answer lists the hashes the replay holds. Like a router that joins late, it
    starts from the status answer's hashes once its subscription delivers (ZeroMQ drops what a PUB sends before
    a SUB has joined)."""
    import msgpack
    import zmq

    from meshnode.dev.nodeproc import NodeProcess

    endpoint = f"ipc://{tmp_path}/kv.sock"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, E.KV_TOPIC)
    held, seqs = set(), []

    def drain():
        while sub.poll(0):
            topic, seq, payload = sub.recv_multipart()
            ts, events, rank = msgpack.unpackb(payload)
            assert topic == E.KV_TOPIC and ts > 0 and rank == 0
            for ev in events:  # signed 64-bit hashes, no tier named: what Dynamo's router keys and credits
                assert ev[0] == "AllBlocksCleared" or (ev[-1] is None and all(-2**63 <= h < 2**63 for h in ev[1]))
            seqs.append(int.from_bytes(seq, "big"))
            replay(events, held)

    system = prompt(40, salt=7)
    with NodeProcess(tiny_model, "--kv-events", endpoint, "--prefix-cache", "node", "--max-active", "2",
                     internal={"engine_kind": "fake"}) as n, n.client() as c:
        sub.connect(endpoint)
        for k in range(200):  # each warm-up stores new blocks, so an event comes once the subscription is up
            c.generate(f"warm{k}", tokens=prompt(20, salt=50 + k), max_tokens=2)
            if sub.poll(100):
                break
        drain()
        held = set(c.status()["capacity"]["cached_blocks"]["hashes"])
        drain()  # what came meanwhile is in the status answer already: replaying it again changes nothing
        for sid, tokens in (("a", system + prompt(10, salt=1)), ("b", system + prompt(12, salt=2)),
                            ("s", prompt(45, salt=3))):
            want = predicted_hit(held, tokens)
            r = c.generate(sid, tokens=tokens, max_tokens=4, ignore_eos=True)
            assert (r.done["usage"]["cached_tokens"] > 0) == want, (sid, want, r.done["usage"])
            assert sub.poll(60_000)  # each finished session stores its blocks
            drain()
        assert set(c.status()["capacity"]["cached_blocks"]["hashes"]) == held
    sub.close()
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no batch lost


@pytest.mark.slow
def test_a_displaced_client_gets_its_done_and_the_gateway_says_429(tiny_model):
    """Through the front: a queued session a better one displaces ends REJECTED_QUEUE_FULL with its done."""
    from meshnode.dev.nodeproc import NodeProcess

    with NodeProcess(tiny_model, "--scheduling-policy", "priority", "--max-active", "1", "--max-queue", "1",
                     internal={"engine_kind": "fake", "fake": {"step_s": 0.01}}) as n, n.client() as c:
        c.submit("run", tokens=prompt(4), max_tokens=500, ignore_eos=True)
        c.submit("low", tokens=prompt(4), max_tokens=2, priority=3)
        c.wait_for(lambda e: e["event"] == "admitted" and e["id"] == "low")
        c.submit("high", tokens=prompt(4), max_tokens=2, priority=-1)
        done = c.wait_for(lambda e: e["event"] == "done" and e["id"] == "low")
        assert done["reason"] == R.REJECTED_QUEUE_FULL and "priority -1" in done["detail"]
        c.cancel("run")
        assert c.wait_for(lambda e: e["event"] == "done" and e["id"] == "high")["reason"] == R.LENGTH
        assert c.status()["telemetry"]["rejected_by_reason"][R.REJECTED_QUEUE_FULL] == 1


def test_through_a_node_a_preempted_session_continues_as_it_would_have_alone(tiny_model):
    """The real engine: a generating low session is preempted by a better one, re-prefilled from its prompt
    and the tokens it streamed, and goes on as it would have alone (bitwise in deterministic mode)."""
    from helpers import assert_as_promised, assert_consistent, deterministic_node
    from meshnode.core.types import Sampling
    from meshnode.dev.nodeproc import NodeProcess

    job = dict(tokens=prompt(9), max_tokens=120, ignore_eos=True, logprobs=2, sampling=Sampling(0.9, 40, 0.95, 7))
    with NodeProcess(tiny_model, "--scheduling-policy", "priority", "--max-active", "2", "--deterministic") as n, \
            n.client() as c:
        alone = c.generate("alone", priority=3, **job)
        c.submit("low", priority=3, **job)
        c.submit("other", tokens=prompt(5, salt=2), max_tokens=400, ignore_eos=True, priority=2)
        kept, seen = [], 0
        while seen < 20:  # the low session is well into its generation
            kept.append(c.recv(60))
            seen += len(kept[-1]["tokens"]) if kept[-1]["event"] == "tokens" and kept[-1]["id"] == "low" else 0
        c.buffer.extendleft(reversed(kept))
        c.submit("high", tokens=prompt(6, salt=1), max_tokens=30, ignore_eos=True, priority=-1)
        got = c.collect(["low", "other", "high"])
        t = c.status()["telemetry"]
        det = deterministic_node(c, tiny_model)
    assert t["preemptions_total"] == 1  # the worst running one, low; never other (better) nor high
    assert [got[k].done["reason"] for k in ("low", "other", "high")] == [R.LENGTH] * 3
    assert_consistent(got["low"], 120, R.LENGTH)  # each token streamed once, the done carrying them all
    assert_as_promised(got["low"], alone, det)


def test_a_reserved_slot_starts_a_better_request_at_once_and_only_such_a_one():
    engine, sched = scheduler(policy="priority", reserved_slots=1, max_active=3, max_queue=8)
    for key in ("a", "b"):
        assert sched.submit(Session(key, prompt(4), 5)).reason == R.ADMITTED
    assert sched.submit(Session("c", prompt(4), 5)).reason == R.QUEUED  # the last slot is kept
    assert sched.submit(Session("hi", prompt(4), 5, priority=-1)).reason == R.QUEUED  # ahead of c, in the queue
    tick = sched.plan()
    assert {s.key for s in sched.running} == {"a", "b", "hi"} and queued(sched) == ["c"]
    step(sched, engine, tick)
    ends = [ev.session.key for ev in run_to_completion(sched, engine) if ev.kind == "done"]
    assert ends[-1] == "c"  # it ran once a slot beyond the reserved one was free
    with pytest.raises(ValueError, match="priority_reserved_slots"):  # not with fcfs: the node refuses to start
        NodeConfig(priority_reserved_slots=1, max_active=3).resolve()


def test_under_the_priority_policy_a_better_sessions_prompt_takes_the_prefill_room_first():
    engine, sched = scheduler(policy="priority", max_active=2, max_batch_size=2, max_prefill_tokens_per_tick=8)
    low = Session("low", prompt(40), 3)
    sched.submit(low)
    step(sched, engine, sched.plan())  # low has started its prompt
    high = Session("high", prompt(20, salt=1), 3, priority=-1)
    sched.submit(high)
    tick = sched.plan()
    first = [c for c in tick.plan.chunks if len(c.tokens) > 1][0]
    assert first.seq_id == high.seq_id and len(first.tokens) == 8  # all the room, though low started first
    step(sched, engine, tick)
    ends = [ev.session.key for ev in run_to_completion(sched, engine) if ev.kind == "done"]
    assert ends == ["high", "low"]


@pytest.mark.parametrize("policy,n_prompt,alone", [("priority", 5, True), ("priority", 40, False),
                                                   ("fcfs", 5, False)])
def test_a_better_first_token_that_one_tick_gives_takes_that_tick_alone(policy, n_prompt, alone):
    """Under the priority policy a better request whose whole prompt fits one tick gets a tick of its own:
    its first token does not wait for the worse class's decode rows beside its prefill (on streams a
    llama_decode of their own). A prompt longer than a tick (16 tokens here) goes beside them, as under
    fcfs, where nobody is better: the streams are never stalled for a long prefill."""
    engine, sched = scheduler(policy=policy, max_active=3, steps_ms=0.0, prefix_cache="off",
                              max_prefill_tokens_per_tick=16)
    lows = [Session(f"low{i}", prompt(4, salt=i), 12, priority=3 if policy == "priority" else 0) for i in range(2)]
    for s in lows:
        sched.submit(s)
    events = []
    while any(s.n_generated < 3 for s in lows):
        events += step(sched, engine, sched.plan())
    high = Session("high", prompt(n_prompt, salt=9), 4, priority=-1 if policy == "priority" else 0)
    assert sched.submit(high).reason == R.ADMITTED
    tick = sched.plan()
    seqs = {c.seq_id for c in tick.plan.chunks}
    assert (seqs == {high.seq_id}) == alone
    assert all(s.seq_id in seqs for s in lows) != alone
    events += sched.apply(tick, engine.step(tick.plan))
    assert high.n_generated == (n_prompt <= 16)  # its first token, where its prompt fit the tick
    events += run_to_completion(sched, engine)
    for s in [*lows, high]:  # every token still the one a lone run draws
        assert s.reason == R.LENGTH and engine.expected(s.tokens, len(s.prompt))
