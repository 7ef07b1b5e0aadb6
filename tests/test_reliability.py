"""Reliability: fuzzed frames, overload, engine faults, front death, stalled clients, security."""
import os
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import psutil
import pytest
import zmq
from hypothesis import given, settings, strategies as st

from ipc import protocol as P
from meshnode.core import reasons as R
from ipc.shm import leftover_segments
from ipc.transport import free_tcp_port
from meshnode.client import Client
from meshnode.engine.followups import AWAITING_RESYNC
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess
from helpers import children_of, serve, wait_until

# -- fuzzing the decoder ------------------------------------------------------------------------
ints = st.integers(-(2**63), 2**64 - 1)  # everything msgpack can carry
leaf = st.one_of(st.none(), st.booleans(), ints,
                 st.floats(allow_nan=True), st.text(max_size=300), st.binary(max_size=64))
tree = st.recursive(leaf, lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=12), kids,
                                                                                       max_size=6), max_leaves=30)
ops = st.sampled_from(["submit", "cancel", "status", "ping", "launch", "", 7, None])
request = st.fixed_dictionaries({"op": ops}, optional={
    "id": st.one_of(st.text(max_size=140), ints), "tokens": st.one_of(st.lists(st.integers(-5, 600)), tree),
    "text": st.one_of(st.text(max_size=50), tree), "max_tokens": st.one_of(st.integers(-3, 2**40), tree),
    "sampling": st.one_of(st.fixed_dictionaries({}, optional={"temperature": leaf, "top_k": leaf, "top_p": leaf,
                                                               "seed": leaf}), tree),
    "stop_tokens": tree, "ignore_eos": tree, "recipe": tree})


def decode_only_structured(frames):
    try:
        P.decode_request(frames, 512)
    except P.ProtocolError as e:
        assert e.code in (R.BAD_REQUEST, R.UNSUPPORTED_VERSION, R.TOO_LARGE, R.UNKNOWN_SESSION) and e.detail


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=4))
def test_fuzz_arbitrary_frames(frames):
    decode_only_structured(frames)


@settings(max_examples=200, deadline=None)
@given(st.one_of(request, tree))
def test_fuzz_msgpack_trees(obj):
    decode_only_structured([P.VERSION, msgpack.packb(obj, use_bin_type=True)])


def random_frames(rng: random.Random):
    kind = rng.randrange(6)
    if kind == 0:
        return [bytes(rng.randrange(256) for _ in range(rng.randrange(40)))]
    if kind == 1:
        return [P.VERSION, bytes(rng.randrange(256) for _ in range(rng.randrange(80)))]
    if kind == 2:
        return [b"MN2", msgpack.packb({"op": "ping"})]
    body = {"op": rng.choice(["submit", "cancel", "launch", 5]), "id": rng.choice(["f", 3, "x" * 200, None]),
            "tokens": rng.choice([[1, 2], [999999], "abc", None, [1] * 3]), "max_tokens": rng.choice([-1, "2", 2**50, 0])}
    if kind == 4:
        body = rng.choice([[1, 2], "str", 17, {"op": {"nested": [1]}}])
    return [P.VERSION, msgpack.packb(body), *([b"extra"] if kind == 5 else [])]


def test_three_thousand_random_frames_then_a_valid_session(tiny_model):
    rng = random.Random(1234)
    frames = [random_frames(rng) for _ in range(3000)]
    bad = 0
    for f in frames:
        try:
            P.decode_request(f, 512)
        except P.ProtocolError:
            bad += 1
    assert bad > 2800  # the rest are well-formed cancels of unknown ids: answered, not counted as bad
    with NodeProcess(tiny_model) as n, n.client() as c:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(n.listen)
        answers = 0
        for i in range(0, 3000, 250):  # read as we go: a client that never reads is a stalled client
            for f in frames[i:i + 250]:
                s.send_multipart(f)
            while answers < i + 250 and s.poll(5000):
                ev = P.decode_event(s.recv_multipart())
                assert ev["event"] == "error"
                answers += 1
        s.close()
        ctx.term()
        assert answers == 3000
        assert c.generate("valid", tokens=[3, 4, 5], max_tokens=4).done["reason"] == R.LENGTH
        assert c.status()["telemetry"]["bad_frames_total"] == bad


# -- overload -----------------------------------------------------------------------------------
def test_overload_thousand_submits_nothing_lost(tiny_model):
    with NodeProcess(tiny_model, "--max-active", "8", "--max-queue", "32") as n:
        with n.client() as c:
            rss0 = c.status()["telemetry"]["front_rss_bytes"]
        tally = {"submitted": 0, "admitted": 0, "rejected": 0, "done": 0, "double": 0}
        lock = threading.Lock()

        def worker(k):
            with Client(n.listen, timeout_s=60) as c:
                ids = [f"c{k}-{i}" for i in range(200)]
                for sid in ids:
                    c.submit(sid, tokens=[3 + k, 4, 5], max_tokens=4, ignore_eos=True)
                res = c.collect(ids, timeout_s=120)
                extra = c.recv(0.5)  # nothing more may come: no second done
            with lock:
                tally["submitted"] += len(ids)
                tally["admitted"] += sum(not r.rejected for r in res.values())
                tally["rejected"] += sum(r.rejected for r in res.values())
                tally["done"] += sum(r.done is not None for r in res.values())
                tally["double"] += extra is not None

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with n.client() as c:
            t = c.status()["telemetry"]
    assert tally["submitted"] == 1000 and tally["admitted"] + tally["rejected"] == 1000
    assert tally["done"] == tally["admitted"] and tally["double"] == 0 and tally["rejected"] > 0
    assert t["rejected_by_reason"][R.REJECTED_QUEUE_FULL] == tally["rejected"]
    assert t["kv_bytes"] == 0 and t["active_sessions"] == 0 and t["queue_depth"] == 0
    growth = t["front_rss_bytes"] - rss0
    print(f"overload: admitted {tally['admitted']} rejected {tally['rejected']} front RSS growth {growth / 2**20:.1f} MiB")
    assert growth < 64 * 2**20


# -- engine faults ------------------------------------------------------------------------------
JOBS = {f"f{i}": dict(tokens=[3 + (i * 17 + k) % 500 for k in range(3 + 4 * i)], max_tokens=60, ignore_eos=True,
                      sampling=Sampling(0.8, 40, 0.95, 7 + i) if i % 2 else None) for i in range(3)}


@pytest.fixture(scope="module")
def reference_tokens(tiny_model):
    with NodeProcess(tiny_model) as n, n.client() as c:
        for sid, kw in JOBS.items():
            c.submit(sid, **kw)
        return {sid: r.tokens for sid, r in c.collect(list(JOBS)).items()}


@pytest.mark.parametrize("kind", ["fatal", "raise", "hang", "kill", "bad_sample"])
def test_engine_fault_reprefills_with_identical_tokens(tiny_model, reference_tokens, kind):
    internal = {"faults": [{"kind": kind, "at_tick": 20}, {}]}
    with NodeProcess(tiny_model, "--tick-deadline-s", "1", internal=internal) as n, n.client() as c:
        for sid, kw in JOBS.items():
            c.submit(sid, **kw)
        got = c.collect(list(JOBS))
        t = c.status()["telemetry"]
    assert {sid: r.tokens for sid, r in got.items()} == reference_tokens
    assert all(r.done["reason"] == R.LENGTH for r in got.values())
    assert t["engine"]["restarts"] == 1 and t["healthy"]


def test_a_refused_tick_ends_its_sessions_and_the_node_goes_on(tiny_model, reference_tokens):
    """A non-fatal refusal with a second tick already queued behind it: that tick is refused
    too and planned again after a resync; no restart, and the next session is served exactly."""
    internal = {"faults": [{"kind": "refuse", "at_tick": 20}]}
    with NodeProcess(tiny_model, internal=internal) as n, n.client() as c:
        for sid, kw in JOBS.items():
            c.submit(sid, **kw)
        got = c.collect(list(JOBS))
        c.submit("again", **JOBS["f1"])
        again = c.collect(["again"])["again"]
        t = c.status()["telemetry"]
        log = n.log()
    assert AWAITING_RESYNC in log  # the tick queued behind the refused one was there, and refused
    reasons = {sid: r.done["reason"] for sid, r in got.items()}
    assert R.ENGINE_ERROR in reasons.values() and set(reasons.values()) <= {R.ENGINE_ERROR, R.LENGTH}
    for sid, r in got.items():
        want = reference_tokens[sid]
        assert r.tokens == (want[:len(r.tokens)] if reasons[sid] == R.ENGINE_ERROR else want)
    assert again.tokens == reference_tokens["f1"] and again.done["reason"] == R.LENGTH
    assert t["engine"]["restarts"] == 0 and t["healthy"]


def test_crash_loop_makes_the_node_unhealthy_instead_of_spinning(tiny_model):
    internal = {"faults": [{"kind": "kill", "at_tick": 5}, {"die_at_start": True}]}
    with NodeProcess(tiny_model, internal=internal) as n, n.client() as c:
        c.submit("s", tokens=[3, 4, 5], max_tokens=500, ignore_eos=True)
        done = c.wait_for(lambda e: e["event"] == "done", timeout_s=30)
        assert done["reason"] == R.ENGINE_ERROR
        st_ = c.status()
        assert st_["node"]["healthy"] is False and st_["telemetry"]["engine"]["healthy"] is False
        c.submit("t", tokens=[3], max_tokens=2)
        rej = c.wait_for(lambda e: e["event"] == "rejected")
        assert rej["reason"] == R.REJECTED_ENGINE_UNAVAILABLE and "engine" in rej["detail"]
        restarts = st_["telemetry"]["engine"]["restarts"]
        time.sleep(1.0)
        assert c.status()["telemetry"]["engine"]["restarts"] == restarts  # not spinning


def test_a_model_file_replaced_under_the_node_fails_clearly_at_the_restart(tiny_model, tmp_path):
    """A restart that finds another model cannot re-prefill anyone: the node ends the live session,
    says why, and refuses new work instead of serving a model its tokenizer does not describe."""
    from meshnode.ops.models import make_model

    model = tmp_path / "served.gguf"
    model.write_bytes(open(tiny_model, "rb").read())
    other = make_model(tmp_path / "other.gguf", "tiny", 1)
    with NodeProcess(str(model)) as n, n.client() as c:
        c.submit("live", tokens=[3, 4, 5], max_tokens=4000, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "tokens")
        os.replace(other, model)
        os.kill(c.status()["node"]["engine_pid"], 9)
        done = c.wait_for(lambda e: e["event"] == "done" and e["id"] == "live", timeout_s=60)
        assert done["reason"] == R.ENGINE_ERROR
        node = c.status()["node"]
        assert node["healthy"] is False and "different model" in node["engine_error"]
        c.submit("new", tokens=[3], max_tokens=2)
        rej = c.wait_for(lambda e: e["event"] == "rejected")
        assert rej["reason"] == R.REJECTED_ENGINE_UNAVAILABLE and "restart the node" in rej["detail"]
        assert c.ping()  # the front itself is fine


def test_an_engine_whose_vocabulary_is_not_the_tokenizers_stops_the_start(tiny_model, tmp_path, monkeypatch):
    """The file changed between the front's vocab-only load and the engine's: say so, serve nothing."""
    monkeypatch.setenv("MESHNODE_RUN_DIR", str(tmp_path))
    out = serve(tiny_model, "--listen", f"ipc://{tmp_path}/n.sock", "--telemetry", f"ipc://{tmp_path}/t.sock",
                internal={"engine_kind": "fake", "fake": {"n_vocab": 4096}})
    assert out.returncode == 1 and "the engine's model has 4096 tokens, the front's tokenizer 512" in out.stderr


def test_front_death_takes_the_engine_and_leaves_nothing(tiny_model):
    before = leftover_segments()
    n = NodeProcess(tiny_model).start()
    engine_pid = n.client().status()["node"]["engine_pid"]
    n.proc.kill()
    n.proc.wait()
    t0 = time.monotonic()
    gone = wait_until(lambda: not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == "zombie", 5)
    took = time.monotonic() - t0
    print(f"engine exited {took:.2f} s after the front was killed")
    assert gone and took < 2.0
    assert wait_until(lambda: set(leftover_segments()) <= set(before), 3)
    def left():
        return [f for f in os.listdir(n.run_dir) if f.endswith((".sock", ".lock"))]

    assert wait_until(lambda: not left(), 2), (left(), n.log())


# -- client faults --------------------------------------------------------------------------------
def test_client_that_stops_reading_loses_its_sessions_only(tiny_model):
    with NodeProcess(tiny_model, "--max-active", "8", "--ctx", "8192") as n:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(n.listen)
        for i in range(6):  # never read: the node's send queue to us fills up
            s.send_multipart(P.encode_request(P.Submit(f"stall{i}", 1000, [3 + i, 4], ignore_eos=True)))
        with n.client() as c:
            assert c.generate("meanwhile", tokens=[3, 4, 5], max_tokens=5).done["reason"] == R.LENGTH
            t = wait_until(lambda: (lambda t: t if t["client_faults_total"] >= 1 and t["active_sessions"] == 0
                                    else None)(c.status()["telemetry"]), 30)
            assert t and t["kv_bytes"] == 0
            assert c.generate("after", tokens=[3, 4, 5], max_tokens=5).done["reason"] == R.LENGTH
        s.close()
        ctx.term()


def test_a_client_that_pauses_reading_still_gets_every_done(tiny_model):
    """Eight sessions stream to a client that stops reading for a while: the node cancels them when
    its send queue to the client is full, and keeps each `done` until the client reads again."""
    with NodeProcess(tiny_model, "--max-active", "8", "--ctx", "8192") as n:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(n.listen)
        ids = [f"p{i}" for i in range(8)]
        for i, sid in enumerate(ids):
            s.send_multipart(P.encode_request(P.Submit(sid, 900, [3 + i, 4], ignore_eos=True)))
        with n.client() as c:  # the pause: until the node gives up on this client's sessions
            assert wait_until(lambda: c.status()["telemetry"]["client_faults_total"] >= 1, 30)
            stalled = c.status()["telemetry"]
        done, admitted, deadline = {}, set(), time.monotonic() + 30
        while len(done) < len(ids) and time.monotonic() < deadline:  # reading again
            if s.poll(1000):
                ev = P.decode_event(s.recv_multipart())
                if ev["event"] == "admitted":
                    admitted.add(ev["id"])
                elif ev["event"] == "done":
                    assert ev["id"] not in done
                    done[ev["id"]] = ev
        assert s.poll(300) == 0 or P.decode_event(s.recv_multipart())["event"] == "tokens"
        s.close()
        ctx.term()
        with n.client() as c:
            t = c.status()["telemetry"]
    assert admitted == set(ids) and set(done) == set(ids)
    assert {d["reason"] for d in done.values()} == {R.CANCELLED}
    assert all("stopped reading" in d["detail"] and d["tokens"] for d in done.values())
    assert stalled["clients_stalled"] == 1 and t["clients_stalled"] == 0 and t["kv_bytes"] == 0


# -- security -------------------------------------------------------------------------------------
def test_non_loopback_tcp_needs_curve_or_insecure(tiny_model, tmp_path):
    out = serve(tiny_model, "--listen", f"tcp://0.0.0.0:{free_tcp_port()}",
                "--telemetry", f"ipc://{tmp_path}/t.sock")
    assert out.returncode == 2 and "CURVE" in out.stderr and "listen" in out.stderr
    port = free_tcp_port()
    with NodeProcess(tiny_model, "--insecure", listen=f"tcp://0.0.0.0:{port}",
                     connect=f"tcp://127.0.0.1:{port}") as n:
        with n.client() as c:
            assert c.ping()


def test_curve_admits_known_clients_only(tiny_model, tmp_path):
    import zmq.auth

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    _, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    zmq.auth.create_certificates(str(keys), "stranger")
    os.rename(client_public, allowed / "client.key")
    server_pub, _ = zmq.auth.load_certificate(server_secret)
    port = free_tcp_port()
    known = {"server_public_key": server_pub, "client_cert": zmq.auth.load_certificate(client_secret)}
    with NodeProcess(tiny_model, "--curve-secret-key", server_secret, "--curve-allow-dir", str(allowed),
                     listen=f"tcp://127.0.0.1:{port}", client_kw=known) as n:
        with n.client(timeout_s=5) as c:
            assert c.generate("c", tokens=[3, 4], max_tokens=2).done["reason"] == R.LENGTH
        stranger = zmq.auth.load_certificate(str(keys / "stranger.key_secret"))
        with Client(n.listen, timeout_s=2, server_public_key=server_pub, client_cert=stranger) as c:
            assert not c.ping(2.0)
        with Client(n.listen, timeout_s=2) as c:  # plaintext
            assert not c.ping(2.0)


def test_second_node_on_the_same_ipc_path_refuses(tiny_model):
    with NodeProcess(tiny_model) as n:
        out = serve(tiny_model, "--listen", n.listen, "--telemetry", n.telemetry + ".2")
        assert out.returncode == 1 and "in use by another meshnode" in out.stderr
        with n.client() as c:
            assert c.ping()


# -- failed starts ------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", [["--ctx", "1"], ["--n-batch", "1"], ["--tick-deadline-s", "0"],
                                     ["--tick-deadline-s", "nan"], ["--threads", "-1"]])
def test_a_value_llama_cpp_would_refuse_stops_the_start_with_exit_2(tiny_model, tmp_path, setting):
    t0 = time.monotonic()
    out = serve(tiny_model, *setting, "--listen", f"ipc://{tmp_path}/n.sock", "--telemetry", f"ipc://{tmp_path}/t.sock")
    key = setting[0][2:].replace("-", "_")
    assert out.returncode == 2 and key.replace("ctx", "ctx") in out.stderr, out.stderr
    assert time.monotonic() - t0 < 10


def test_a_quantized_v_cache_without_flash_attention_stops_the_start_with_exit_2(tiny_model, tmp_path):
    cfg = tmp_path / "n.toml"
    cfg.write_text('type_v = "q4_0"\nflash_attn = "off"\n')
    out = serve(tiny_model, "--config", str(cfg), "--listen", f"ipc://{tmp_path}/n.sock",
                "--telemetry", f"ipc://{tmp_path}/t.sock")
    assert out.returncode == 2 and "type_v" in out.stderr and "flash attention" in out.stderr


def test_an_engine_that_dies_before_hello_ends_the_start_at_once_with_its_words(tiny_model, tmp_path, monkeypatch):
    """A GGML_ASSERT while loading: the start ends in seconds, with the exit status and llama.cpp's
    message, instead of the front spinning on a closed link until its start timeout."""
    monkeypatch.setenv("MESHNODE_RUN_DIR", str(tmp_path))
    t0 = time.monotonic()
    out = serve(tiny_model, "--listen", f"ipc://{tmp_path}/n.sock", "--telemetry", f"ipc://{tmp_path}/t.sock",
                internal={"faults": [{"abort_at_start": True}]})
    assert out.returncode == 1 and time.monotonic() - t0 < 20
    line = next(ln for ln in out.stderr.splitlines() if "cannot serve" in ln)
    assert "exited (code -6)" in line and "llama.cpp aborted" in line and "GGML_ASSERT(injected) failed" in line
    assert "#0 " not in out.stderr  # no gdb backtrace dumped into the log


def test_an_abort_mid_generation_is_reported_and_the_engine_restarts(tiny_model, reference_tokens):
    internal = {"faults": [{"kind": "abort", "at_tick": 20}, {}]}
    with NodeProcess(tiny_model, internal=internal) as n, n.client() as c:
        for sid, kw in JOBS.items():
            c.submit(sid, **kw)
        got = c.collect(list(JOBS))
        t = c.status()["telemetry"]
        log = n.log()
    assert {sid: r.tokens for sid, r in got.items()} == reference_tokens
    assert t["engine"]["restarts"] == 1 and "llama.cpp aborted: injected:0: GGML_ASSERT(injected) failed" in log


# -- descriptors ------------------------------------------------------------------------------------
def test_idle_connections_cannot_exhaust_the_descriptors(tiny_model):
    """At systemd's default limit of 1024, 1,100 idle connections used to abort the front inside
    libzmq: now the ones beyond the cap are closed, the live session goes on, and an engine restart
    still finds the descriptors it needs."""
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    with NodeProcess(tiny_model, nofile=1024) as n, n.client() as c:
        want = c.generate("ref", tokens=[3, 4, 5], max_tokens=200, ignore_eos=True).tokens
        c.submit("live", tokens=[3, 4, 5], max_tokens=200, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "tokens", keep=True)
        idle = []
        for _ in range(1100):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(n.listen[len("ipc://"):])
            except OSError:  # refused by the kernel once the node is closing them as they come
                s.close()
                continue
            idle.append(s)
        t = wait_until(lambda: (lambda t: t if t["clients_refused_total"] > 0 else None)(c.status()["telemetry"]), 10)
        assert t and t["fds_open"] < t["fds_limit"] == 1024
        os.kill(c.status()["node"]["engine_pid"], 9)
        got = c.collect(["live"], timeout_s=60)["live"]
        t = c.status()["telemetry"]
        for s in idle:
            s.close()
    assert n.proc.returncode == 0, n.log()
    assert got.tokens == want and got.done["reason"] == R.LENGTH
    assert t["engine"]["restarts"] == 1 and t["healthy"]
    print(f"idle connections: {t['clients_connected']} held, {t['clients_refused_total']} closed; "
          f"{t['fds_open']} of {t['fds_limit']} descriptors open")


@pytest.mark.parametrize("flag, endpoint, key", [
    ("--telemetry", "tcp://0.0.0.0:{port}", "telemetry"),
    ("--metrics-listen", "0.0.0.0:{port}", "metrics_listen"),
    ("--listen", "ipc://@meshnode-abstract-{port}", "listen"),
])
def test_every_endpoint_others_can_reach_needs_curve_or_insecure(tiny_model, tmp_path, flag, endpoint, key):
    ep = endpoint.format(port=free_tcp_port())
    args = ["--listen", f"ipc://{tmp_path}/n.sock", "--telemetry", f"ipc://{tmp_path}/t.sock", flag, ep]
    out = serve(tiny_model, *args)
    assert out.returncode == 2 and key in out.stderr and "--insecure" in out.stderr, out.stderr


def test_an_abstract_socket_with_insecure_serves_and_drops_no_lock_in_the_working_dir(tiny_model, tmp_path):
    name = f"ipc://@meshnode-test-{os.getpid()}"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with NodeProcess(tiny_model, "--insecure", listen=name) as n, n.client() as c:
            assert c.ping()
            assert not [f for f in os.listdir(tmp_path) if f.endswith(".lock")]
    finally:
        os.chdir(cwd)


def test_curve_protects_the_telemetry_too(tiny_model, tmp_path):
    import subprocess
    import zmq.auth

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    os.rename(client_public, allowed / "client.key")
    server_pub, _ = zmq.auth.load_certificate(server_secret)
    port, tport = free_tcp_port(), free_tcp_port()
    known = {"server_public_key": server_pub, "client_cert": zmq.auth.load_certificate(client_secret)}
    top = [sys.executable, "-m", "meshnode", "top", "--once", "--timeout", "3", "--connect", f"tcp://127.0.0.1:{tport}"]
    with NodeProcess(tiny_model, "--curve-secret-key", server_secret, "--curve-allow-dir", str(allowed),
                     "--telemetry", f"tcp://0.0.0.0:{tport}", listen=f"tcp://0.0.0.0:{port}",
                     connect=f"tcp://127.0.0.1:{port}", client_kw=known):
        stranger = subprocess.run(top, capture_output=True, text=True, timeout=30)
        member = subprocess.run(top + ["--curve-server-key", server_public, "--curve-client-cert", client_secret],
                                capture_output=True, text=True, timeout=30)
    assert stranger.returncode == 1 and "no telemetry" in stranger.stderr
    assert member.returncode == 0 and "recipe mn1-" in member.stdout


# -- leftovers and signals at start -------------------------------------------------------------------
def run_files(run_dir):
    return sorted(f for f in os.listdir(run_dir) if f.endswith((".sock", ".lock")))


def test_a_front_killed_after_a_crash_loop_leaves_nothing(tiny_model):
    """No engine is left to clean up after a front in a crash loop: its reaper does."""
    before = leftover_segments()
    internal = {"faults": [{"kind": "kill", "at_tick": 5}, {"die_at_start": True}]}
    n = NodeProcess(tiny_model, internal=internal).start()
    with n.client() as c:
        c.submit("s", tokens=[3, 4, 5], max_tokens=500, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "done", timeout_s=30)
        assert not c.status()["node"]["healthy"]
    assert run_files(n.run_dir)  # the node's sockets and locks, while it lives
    n.proc.kill()
    n.proc.wait()
    assert wait_until(lambda: not run_files(n.run_dir), 3), run_files(n.run_dir)
    assert wait_until(lambda: set(leftover_segments()) <= set(before), 3)


def test_a_second_node_refused_at_its_second_endpoint_leaves_nothing_of_its_own(tiny_model, tmp_path):
    with NodeProcess(tiny_model) as a:
        out = serve(tiny_model, "--listen", f"ipc://{tmp_path}/b.sock", "--telemetry", a.telemetry)
        assert out.returncode == 1 and "in use by another meshnode" in out.stderr
        assert run_files(tmp_path) == []  # b.sock.lock was taken, then released with the refusal
        with a.client() as c:
            assert c.ping()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_is_a_clean_stop(tiny_model, sig):
    before = leftover_segments()
    n = NodeProcess(tiny_model, internal={"faults": [{"sleep_at_start": 30}]})
    n._log = open(n.log_path, "w")
    n.proc = subprocess.Popen(n.args, env=n.env, stdout=n._log, stderr=subprocess.STDOUT)
    assert wait_until(lambda: children_of(n.proc.pid), 20)  # the engine is loading the model
    time.sleep(0.5)
    n.proc.send_signal(sig)
    assert n.proc.wait(15) == 0, n.log()
    n._log.close()
    assert "Traceback" not in n.log() and "stopped by a signal during start-up" in n.log()
    assert wait_until(lambda: not run_files(n.run_dir), 3) and set(leftover_segments()) <= set(before)


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
