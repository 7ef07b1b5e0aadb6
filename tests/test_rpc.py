"""One model over llama.cpp's RPC backend (issue 26): two `meshnode rpc-worker`s on 127.0.0.1, the tiny
model's layers split between the node's own engine and both workers.

The README's install builds llama-cpp-python with -DGGML_RPC=ON; a build without it fails here with the
fix, never a skip."""
import signal
import subprocess
import sys

import pytest

from helpers import run_jobs, serve, wait_until
from ipc.transport import free_tcp_port
from meshnode.core import reasons as R
from meshnode.dev.nodeproc import NodeProcess
from meshnode.dev.rpcproc import DelayProxy, RpcWorker
from meshnode.engine.devices import RPC_FIX

JOBS = {f"r{i}": dict(tokens=[5 + (i * 31 + k) % 400 for k in range(4 + 5 * i)], max_tokens=48, ignore_eos=True)
        for i in range(3)}


@pytest.fixture
def workers():
    ws = [RpcWorker().start(), RpcWorker().start()]
    yield ws
    for w in ws:
        w.kill()


def test_this_build_has_the_rpc_backend():
    import llama_cpp

    assert llama_cpp.llama_supports_rpc(), f"llama-cpp-python was built without RPC: {RPC_FIX}"


@pytest.fixture(scope="module")
def local_tokens(tiny_model):
    with NodeProcess(tiny_model) as n, n.client() as c:
        return run_jobs(c, JOBS)


def test_a_model_split_over_two_workers_decodes_what_a_local_node_decodes(tiny_model, workers, local_tokens):
    rpc = ",".join(w.endpoint for w in workers)
    with NodeProcess(tiny_model, "--rpc", rpc, "--gpu-layers", "3") as n, n.client() as c:
        got = run_jobs(c, JOBS)
        node = c.status()["node"]
        log = n.log()
    where = {d["name"]: d for d in node["devices"]}
    assert where["CPU"]["layers"] == [0, 1]  # 5 layers (4 + output), the last 3 offloaded
    assert sorted(where["RPC0"]["layers"] + where["RPC1"]["layers"]) == [2, 3, 4]
    assert {where["RPC0"]["endpoint"], where["RPC1"]["endpoint"]} == {w.endpoint for w in workers}
    assert all(d["weight_bytes"] > 0 and d["mem_total"] > 0 for d in where.values())
    assert all(d["kv_bytes"] > 0 for d in where.values() if min(d["layers"]) < 4)  # layer 4 is the output: no KV
    assert node["budgets"]["weight_bytes"] == where["CPU"]["weight_bytes"]  # the host holds only its share
    assert f"RPC0@{workers[0].endpoint}[" in log  # the ready line says where the layers are
    for sid in JOBS:
        assert got[sid].tokens == local_tokens[sid].tokens, sid
    assert node["recipe"] != local_recipe(tiny_model)  # other devices, another fingerprint


def test_tensor_split_and_device_place_the_layers_as_told(tiny_model, workers):
    """llama-server's meanings through a node: --tensor-split 1,2 gives RPC1 twice RPC0's share of the 3
    offloaded layers; --device RPC1 puts them all on RPC1 and none on RPC0."""
    rpc = ",".join(w.endpoint for w in workers)

    def layers(*flags):
        with NodeProcess(tiny_model, "--rpc", rpc, "--gpu-layers", "3", *flags) as n, n.client() as c:
            return {d["name"]: d["layers"] for d in c.status()["node"]["devices"]}

    split = layers("--tensor-split", "1,2")
    assert len(split["RPC0"]) == 1 and len(split["RPC1"]) == 2 and split["CPU"] == [0, 1], split
    only = layers("--device", "RPC1")
    assert only["RPC1"] == [2, 3, 4] and not only.get("RPC0"), only


def test_a_workers_memory_cap_fails_the_load_with_llama_cpps_words_and_an_unknown_device_is_refused(tiny_model,
                                                                                                    tmp_path,
                                                                                                    monkeypatch):
    """rpc-worker --mem-mb: an allocation past the cap fails the node's model load (exit 1, llama.cpp's
    message) while the same node loads on an uncapped worker; --device with a name llama.cpp lacks is refused
    in one line, and CPU (the default's) serves."""
    monkeypatch.setenv("MESHNODE_RUN_DIR", str(tmp_path))
    with RpcWorker(extra=("--mem-mb", "1")) as capped:
        out = serve(tiny_model, "--rpc", capped.endpoint, "--gpu-layers", "5", "--listen",
                    f"ipc://{tmp_path}/n.sock", "--telemetry", f"ipc://{tmp_path}/t.sock", timeout=120)
    assert out.returncode == 1 and "failed to allocate RPC0" in out.stderr, out.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "meshnode", "rpc-worker", "--listen", f"127.0.0.1:{free_tcp_port()}",
                          "--device", "NOPE"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no device 'NOPE'" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    with RpcWorker(extra=("--device", "CPU")) as cpu, NodeProcess(tiny_model, "--rpc", cpu.endpoint,
                                                                  "--gpu-layers", "3") as n, n.client() as c:
        assert c.generate("x", tokens=[3, 4], max_tokens=3).done["reason"] == R.LENGTH


def local_recipe(model):
    from meshnode.ops.config import engine_config

    return engine_config(model).recipe()


def test_a_worker_killed_mid_generation_ends_every_session_once_and_the_node_comes_back(tiny_model, workers,
                                                                                        local_tokens):
    rpc = ",".join(w.endpoint for w in workers)
    with NodeProcess(tiny_model, "--rpc", rpc, "--gpu-layers", "3") as n, n.client() as c:
        for sid, kw in JOBS.items():
            c.submit(sid, **{**kw, "max_tokens": 4000})
        c.wait_for(lambda ev: ev["event"] == "tokens", keep=True)  # generation is under way
        workers[1].kill()
        got = c.collect(list(JOBS))
        for sid in JOBS:
            assert got[sid].done["reason"] == R.ENGINE_ERROR and workers[1].endpoint in got[sid].done["detail"]
        assert c.ping(), n.log()
        st = c.status()["node"]
        assert st["engine_state"] != "READY" and workers[1].endpoint in st["engine_missing"] and not st["healthy"]
        refused = c.generate("late", **JOBS["r0"]).admission
        assert refused["event"] == "rejected" and refused["reason"] == R.REJECTED_ENGINE_UNAVAILABLE
        assert workers[1].endpoint in refused["detail"]
        workers[1] = RpcWorker(workers[1].port).start()  # the operator (or systemd) brings it back: no one touches the node
        assert wait_until(lambda: c.status()["node"]["engine_state"] == "READY", timeout_s=120)
        assert c.status()["node"]["healthy"]
        again = c.generate("again", **JOBS["r1"])
        assert again.tokens == local_tokens["r1"].tokens
        assert "answers again: restarting the engine" in n.log()


def test_a_worker_that_is_not_there_stops_the_start_with_one_line(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNODE_RUN_DIR", str(tmp_path))
    absent = f"127.0.0.1:{free_tcp_port()}"
    out = serve(tiny_model, "--rpc", absent, "--listen", f"ipc://{tmp_path}/n.sock",
                "--telemetry", f"ipc://{tmp_path}/t.sock")
    line = next(ln for ln in out.stderr.splitlines() if "cannot serve" in ln)
    assert out.returncode == 1 and f"rpc worker {absent} unreachable" in line and "meshnode rpc-worker" in line


def test_a_worker_that_accepts_but_never_answers_stops_the_start_with_one_line(tiny_model, tmp_path, monkeypatch):
    """A port that accepts connections and never says a word (a stopped worker, another program): the
    start check's own hello times out (--rpc-timeout-s) and the node exits 1 naming it, instead of
    waiting out start_timeout_s (300 s) in ggml's blocking connect."""
    import socket

    monkeypatch.setenv("MESHNODE_RUN_DIR", str(tmp_path))
    with socket.create_server(("127.0.0.1", 0)) as mute:
        where = f"127.0.0.1:{mute.getsockname()[1]}"
        out = serve(tiny_model, "--rpc", where, "--rpc-timeout-s", "1", "--listen", f"ipc://{tmp_path}/n.sock",
                    "--telemetry", f"ipc://{tmp_path}/t.sock", "--start-timeout-s", "600")
    line = next(ln for ln in out.stderr.splitlines() if "cannot serve" in ln)
    assert out.returncode == 1 and f"rpc worker {where} does not answer" in line, out.stderr


def test_a_worker_stopped_mid_generation_turns_the_node_unhealthy_naming_it(tiny_model, workers, local_tokens):
    """SIGSTOP on a worker: its TCP connections stay open and ggml waits on it for ever. Past the tick
    deadline the engine is judged hung, every session ends once, and the restart's hello probe finds the
    silent worker: `healthy: false`, `engine_missing` naming it; SIGCONT, and the node serves again."""
    import os

    rpc = ",".join(w.endpoint for w in workers)
    with NodeProcess(tiny_model, "--rpc", rpc, "--gpu-layers", "3", "--tick-deadline-s", "2",
                     "--rpc-timeout-s", "1") as n, n.client() as c:
        for sid, kw in JOBS.items():
            c.submit(sid, **{**kw, "max_tokens": 4000})
        c.wait_for(lambda ev: ev["event"] == "tokens", keep=True)
        os.kill(workers[1].proc.pid, signal.SIGSTOP)
        try:
            got = c.collect(list(JOBS), timeout_s=120)
            st = c.status()["node"]
        finally:
            os.kill(workers[1].proc.pid, signal.SIGCONT)
        assert all(got[sid].done["reason"] == R.ENGINE_ERROR for sid in JOBS), [got[s].done for s in JOBS]
        assert not st["healthy"] and workers[1].endpoint in st["engine_missing"], st
        assert wait_until(lambda: c.status()["node"]["engine_state"] == "READY", timeout_s=120), n.log()
        assert c.generate("again", **JOBS["r1"]).tokens == local_tokens["r1"].tokens


@pytest.mark.parametrize("listen", ["0.0.0.0:50999", "10.1.2.3:50999"])
def test_a_worker_refuses_an_address_others_can_reach_without_insecure(listen):
    out = subprocess.run([sys.executable, "-m", "meshnode", "rpc-worker", "--listen", listen], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "no authentication" in out.stderr and "--insecure" in out.stderr


def test_a_worker_stops_cleanly_on_sigterm():
    w = RpcWorker().start()
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(timeout=30) == 0
    assert "stopping" in w.proc.stderr.read()
    w.kill()


def test_the_delay_proxy_holds_each_direction_and_keeps_order():
    """What `bench rpc` puts between a node and its workers where netem is missing."""
    import socket as so
    import time

    echo = so.create_server(("127.0.0.1", 0))

    def serve_echo():
        conn, _ = echo.accept()
        while data := conn.recv(65536):
            conn.sendall(data)
        conn.close()

    import threading
    threading.Thread(target=serve_echo, daemon=True).start()
    proxy = DelayProxy(f"127.0.0.1:{echo.getsockname()[1]}", one_way_ms=20)
    c = so.create_connection(("127.0.0.1", int(proxy.endpoint.rsplit(":", 1)[1])))
    t0 = time.monotonic()
    for k in range(3):
        c.sendall(bytes([k]) * 10)
    got = b""
    while len(got) < 30:
        got += c.recv(65536)
    assert got == bytes([0]) * 10 + bytes([1]) * 10 + bytes([2]) * 10
    assert time.monotonic() - t0 >= 0.04  # a lower bound only: both directions held at least 20 ms
    c.close()
    proxy.close()
    echo.close()


def test_a_restarted_engine_is_given_the_first_ones_placement():
    """By default llama.cpp splits layers by free memory, which moves: later incarnations get the first one's
    split pinned, so their recipe (which includes the placement) matches."""
    from meshnode.core.types import Device, EngineInfo

    devices = (Device("CPU", "cpu", "", 1, 1, (0, 1)), Device("RPC0", "gpu", "h:1", 1, 1, (2, 3)),
               Device("RPC1", "gpu", "h:2", 1, 1, (4,)))
    info = EngineInfo(512, 2, (2,), 8, 4096, 512, 512, 2048, 10, "mn1-x", devices=devices)
    assert info.placement() == {"gpu_layers": 3, "devices": ("RPC0", "RPC1"), "tensor_split": (2.0, 1.0)}
    assert EngineInfo(512, 2, (2,), 8, 4096, 512, 512, 2048, 10, "mn1-x", devices=devices[:1]).placement() == {}
