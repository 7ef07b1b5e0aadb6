"""Exposure: CURVE, --insecure, abstract sockets, one node per endpoint."""
import os
import subprocess
import sys

import pytest

from helpers import curve_keys, serve
from ipc.transport import free_tcp_port
from meshnode.client import Client
from meshnode.core import reasons as R
from meshnode.dev.nodeproc import NodeProcess


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

    allowed, _, server_secret, secrets = curve_keys(tmp_path, "client", "stranger")
    server_pub, _ = zmq.auth.load_certificate(server_secret)
    port = free_tcp_port()
    known = {"server_public_key": server_pub, "client_cert": zmq.auth.load_certificate(secrets["client"])}
    with NodeProcess(tiny_model, "--curve-secret-key", server_secret, "--curve-allow-dir", str(allowed),
                     listen=f"tcp://127.0.0.1:{port}", client_kw=known) as n:
        with n.client(timeout_s=5) as c:
            assert c.generate("c", tokens=[3, 4], max_tokens=2).done["reason"] == R.LENGTH
        stranger = zmq.auth.load_certificate(secrets["stranger"])
        with Client(n.listen, timeout_s=1, server_public_key=server_pub, client_cert=stranger) as c:
            assert not c.ping(1.0)
        with Client(n.listen, timeout_s=1) as c:  # plaintext
            assert not c.ping(1.0)


def test_curve_clients_prove_who_they_are_so_their_imports_kv_is_loaded(tiny_model, tmp_path):
    """Without a mesh key a node loads KV only from clients it admitted by their CURVE keys: a session exported by
    a plain node and imported through CURVE goes on with its KV (cached), the same import on plain ipc prefilled."""
    import zmq.auth

    allowed, _, server_secret, secrets = curve_keys(tmp_path, "client")
    server_pub, _ = zmq.auth.load_certificate(server_secret)
    known = {"server_public_key": server_pub, "client_cert": zmq.auth.load_certificate(secrets["client"])}
    port = free_tcp_port()
    ask = dict(tokens=[3 + (k * 29) % 500 for k in range(37)], max_tokens=200, ignore_eos=True)
    with NodeProcess(tiny_model, "--threads", "1", "--decode-steps-ms", "0",
                     internal={"faults": [{"step_sleep_s": 0.03}]}) as a, a.client() as ca, \
            NodeProcess(tiny_model, "--threads", "1", "--prefix-cache", "off", "--curve-secret-key", server_secret,
                        "--curve-allow-dir", str(allowed), listen=f"tcp://127.0.0.1:{port}", client_kw=known) as b, \
            b.client(timeout_s=60) as cb:
        ca.submit("m", **ask)
        ca.wait_for(lambda e: e["event"] == "tokens" and e["id"] == "m", keep=True)
        state = ca.export("m")
        ca.collect(["m"])
        cb.resume("m", state)
        went = cb.collect(["m"])["m"].done
    assert state["kv"]["bytes"] > 0 and "mac" not in state["kv"]
    assert went["reason"] == R.LENGTH and went["usage"]["cached_tokens"] == state["kv"]["positions"] > 0


def test_second_node_on_the_same_ipc_path_refuses(tiny_model):
    with NodeProcess(tiny_model) as n:
        out = serve(tiny_model, "--listen", n.listen, "--telemetry", n.telemetry + ".2")
        assert out.returncode == 1 and "in use by another meshnode" in out.stderr
        with n.client() as c:
            assert c.ping()


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
    import zmq.auth

    allowed, server_public, server_secret, secrets = curve_keys(tmp_path, "client")
    client_secret = secrets["client"]
    server_pub, _ = zmq.auth.load_certificate(server_secret)
    port, tport = free_tcp_port(), free_tcp_port()
    known = {"server_public_key": server_pub, "client_cert": zmq.auth.load_certificate(client_secret)}
    top = [sys.executable, "-m", "meshnode", "top", "--once", "--timeout", "1.5", "--connect", f"tcp://127.0.0.1:{tport}"]
    with NodeProcess(tiny_model, "--curve-secret-key", server_secret, "--curve-allow-dir", str(allowed),
                     "--telemetry", f"tcp://0.0.0.0:{tport}", listen=f"tcp://0.0.0.0:{port}",
                     connect=f"tcp://127.0.0.1:{port}", client_kw=known):
        stranger = subprocess.run(top, capture_output=True, text=True, timeout=30)
        member = subprocess.run(top + ["--curve-server-key", server_public, "--curve-client-cert", client_secret],
                                capture_output=True, text=True, timeout=30)
    assert stranger.returncode == 1 and "no telemetry" in stranger.stderr
    assert member.returncode == 0 and "recipe mn1-" in member.stdout


@pytest.mark.parametrize("listen, hosts, open_", [
    ("127.0.0.1:8080", ["127.0.0.1"], False), ("127.0.0.1,::1:8080", ["127.0.0.1", "::1"], False),
    ("[::1],localhost:80", ["::1", "localhost"], False), ("127.0.0.1,0.0.0.0:8080", ["127.0.0.1", "0.0.0.0"], True)])
def test_the_http_api_listens_on_several_addresses_and_is_open_if_any_of_them_is(listen, hosts, open_):
    """llama-server's `--host 127.0.0.1,::1`: one port on each address; the exposure rule judges every one."""
    from ipc.transport import exposure
    from meshnode.core.endpoints import hosts_port
    from meshnode.gateway.options import refusal

    assert hosts_port(listen) == (hosts, int(listen.rsplit(":", 1)[1]))
    assert bool(exposure(f"tcp://{listen}")) == open_
    assert bool(refusal(listen, set(), insecure=False)) == open_
    for bad in ("127.0.0.1,:80", ":80", "127.0.0.1:0", "127.0.0.1"):
        with pytest.raises(ValueError, match="HOST"):
            hosts_port(bad)


def test_under_client_scope_another_clients_status_cannot_confirm_a_guess_of_a_prompt(tiny_model):
    """`status` lists the cached blocks a client could reuse: with prefix_cache = client, its own, never
    another's (whose hashes, documented, would confirm a guessed prompt offline)."""
    from helpers import prompt

    secret = prompt(64, salt=9)
    with NodeProcess(tiny_model, internal={"engine_kind": "fake"}) as n, n.client() as owner, n.client() as other:
        assert owner.generate("s", tokens=secret, max_tokens=2).done["reason"] == R.LENGTH
        mine = owner.status()["capacity"]["cached_blocks"]["hashes"]
        theirs = other.status()["capacity"]["cached_blocks"]["hashes"]
    assert mine and theirs == []
