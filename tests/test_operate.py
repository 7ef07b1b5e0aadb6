"""Operating a node: config file, drain, sd_notify, tools/top, /metrics."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import psutil
import pytest

from helpers import assert_clean, assert_routable, prompt, router_metrics, wait_until
from ipc.shm import leftover_segments
from ipc.transport import free_tcp_port
from meshnode.core import reasons as R
from meshnode.core.types import ConfigError
from meshnode.dev.nodeproc import NodeProcess
from meshnode.ops import config, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, text):
    p = tmp_path / "node.toml"
    p.write_text(text)
    return str(p)


def test_config_file_then_flags(tmp_path, tiny_model):
    path = write(tmp_path, f'model = "{tiny_model}"\nmax_queue = 5\nprefill_chunk = 32\nkv_budget_mb = 2\n')
    cfg = config.load(path, {"max_queue": 7, "prefill_chunk": None})
    assert cfg.max_queue == 7 and cfg.prefill_chunk == 32 and cfg.kv_budget_mb == 2.0


def test_environment_sits_between_the_file_and_the_flags(tmp_path, tiny_model):
    path = write(tmp_path, f'model = "{tiny_model}"\nmax_queue = 5\nthreads = 3\ninsecure = false\n')
    env = {"MESHNODE_MAX_QUEUE": "6", "MESHNODE_THREADS": "1", "MESHNODE_INSECURE": "yes", "MESHNODE_RUN_DIR": "/x"}
    cfg = config.load(path, {"max_queue": 7}, env)
    assert (cfg.max_queue, cfg.threads, cfg.insecure) == (7, 1, True)
    assert config.load(path).threads == 3  # nothing from os.environ unless the caller passes it


@pytest.mark.parametrize("name, value", [("MESHNODE_MAX_QUEUE", "five"), ("MESHNODE_INSECURE", "maybe"),
                                         ("MESHNODE_MAX_QUEUE", "-1")])
def test_environment_errors_name_the_variable_or_the_key(name, value):
    with pytest.raises(ConfigError, match=name.removeprefix("MESHNODE_").lower()):
        config.load(None, None, {name: value})


@pytest.mark.parametrize("text, key", [
    ("max_qeue = 5\n", "max_qeue"),
    ('max_queue = "five"\n', "max_queue"),
    ("max_active = 0\n", "max_active"),
    ("kv_budget_mb = -1\n", "kv_budget_mb"),
    ('type_k = "f8"\n', "type_k"),
    ("pipeline_depth = 3\n", "pipeline_depth"),
    ("insecure = 1\n", "insecure"),
    ('model = "/nonexistent.gguf"\n', "model"),
    ("engine_factory = 'x:y'\n", "engine_factory"),  # internal knobs are not config keys
    ("max_queue = [\n", "not valid TOML"),
    ("n_seq_max = 4\nmax_batch = 8\n", "max_batch: 8 is more than n_seq_max"),
])
def test_config_errors_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key):
        config.load(write(tmp_path, text))


def test_defaults_let_every_session_reach_4096_tokens():
    assert config.NodeConfig().layout == "streams" and config.NodeConfig().n_ctx == 8 * 4096
    assert config.NodeConfig(kv_layout="unified").n_ctx == 4096  # one pool: any one session may take it all
    assert config.NodeConfig(ctx=1000, n_seq_max=4).n_ctx == 1000
    wide = config.load(None, {"max_active": 64, "max_batch": 64})  # n_seq_max follows: 64 sessions at 4,096
    assert wide.n_seq_max == 64 and wide.n_ctx == 64 * 4096


def test_the_example_file_and_the_flags_come_from_the_one_list_of_settings():
    """tools/meshnode.toml.example is what `meshnode config-example` writes, and every setting has a flag
    whose value overrides the file's; regenerate the file after changing a setting."""
    from meshnode.cli import build_parser

    assert open(os.path.join(ROOT, "tools", "meshnode.toml.example")).read() == flags.example_file()
    a = build_parser().parse_args(["serve", "--type-v", "q8_0", "--max-clients-per-host", "3", "--insecure",
                                   "--log-level", "debug"])
    given = {k: getattr(a, k) for k in config.public_keys()}
    assert given["type_v"] == "q8_0" and given["max_clients_per_host"] == 3 and given["insecure"] is True
    cfg = config.load(None, {k: v for k, v in given.items() if k != "model"})
    assert cfg.type_v == "q8_0" and cfg.log_level == "DEBUG" and cfg.max_queue == 64  # unset flags: defaults
    a = build_parser().parse_args(["serve", "-ctk", "q4_0", "--cache-type-v", "q8_0"])  # llama-server's names
    assert (a.type_k, a.type_v) == ("q4_0", "q8_0")
    with pytest.raises(ConfigError, match="type_k: must be one of f32, f16"):
        config.load(None, {"type_k": "q2_k"})


def test_example_file_documents_every_key_and_only_real_ones():
    example = open(os.path.join(ROOT, "tools", "meshnode.toml.example")).read()
    keys = {m.group(1) for m in re.finditer(r"^#? ?([a-z_]+) *=", example, re.M)}
    assert set(config.public_keys()) <= keys
    assert keys - set(config.public_keys()) == set()


@pytest.mark.slow
def test_serve_reports_a_config_error_and_exits_2(tmp_path):
    path = write(tmp_path, "max_queue = -4\n")
    out = subprocess.run([sys.executable, "-m", "meshnode", "serve", "--config", path], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "max_queue" in out.stderr


def test_drain_finishes_short_sessions_queued_ones_too_and_drains_the_rest(tiny_model):
    """Paced by the fake engine (5 ms a tick): the short sessions need about 0.1 s of the 3 s drain, the
    long ones 20 s, so the outcome does not depend on how busy the machine is. The late submit is sent
    once the node says it is draining."""
    before = leftover_segments()
    fake = {"engine_kind": "fake", "fake": {"step_s": 0.005}}
    n = NodeProcess(tiny_model, "--max-active", "2", "--drain-timeout-s", "3", internal=fake).start()
    with n.client() as c:
        c.submit("long", tokens=[3, 4, 5], max_tokens=4000, ignore_eos=True)
        c.submit("short", tokens=[3, 4, 6], max_tokens=20, ignore_eos=True)
        c.submit("queued-short", tokens=[3, 4, 7], max_tokens=20, ignore_eos=True)  # waits for a slot
        c.submit("queued-long", tokens=[3, 4, 8], max_tokens=4000, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "tokens" and e["id"] == "short", keep=True)
        n.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: c.status()["telemetry"]["draining"], 30)
        c.submit("late", tokens=[3], max_tokens=2)
        res = c.collect(["long", "short", "queued-short", "queued-long", "late"], timeout_s=60)
    assert res["queued-short"].admission["reason"] == res["queued-long"].admission["reason"] == R.QUEUED
    assert res["late"].admission["reason"] == R.REJECTED_DRAINING
    assert res["short"].done["reason"] == res["queued-short"].done["reason"] == R.LENGTH
    assert res["long"].done["reason"] == res["queued-long"].done["reason"] == R.DRAINED
    assert 0 < len(res["long"].tokens) < 4000
    n.proc.wait(60)
    assert_clean(n, before)


def test_second_signal_stops_at_once_still_answering_everyone(tiny_model):
    n = NodeProcess(tiny_model, "--drain-timeout-s", "60").start()
    with n.client() as c:
        c.submit("long", tokens=[3, 4, 5], max_tokens=3000, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "tokens", keep=True)
        n.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: c.status()["telemetry"]["draining"], 30)
        n.proc.send_signal(signal.SIGINT)
        res = c.collect(["long"], timeout_s=10)
    assert res["long"].done["reason"] == R.DRAINED
    assert n.proc.wait(10) == 0


def test_sd_notify_ready_status_stopping_and_engine_does_not_inherit(tiny_model, tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    n = NodeProcess(tiny_model, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}).start()
    msgs = []
    try:
        while not any("READY=1" in m for m in msgs):
            msgs.append(sock.recv(4096).decode())
        with n.client() as c:
            engine_pid = c.status()["node"]["engine_pid"]
        env = psutil.Process(engine_pid).environ()
        assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
        while not any(m.startswith("WATCHDOG=1") for m in msgs):
            msgs.append(sock.recv(4096).decode())
        n.proc.send_signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in msgs):
            msgs.append(sock.recv(4096).decode())
    finally:
        n.stop()
        sock.close()
    lines = [ln for m in msgs for ln in m.split("\n")]
    first = {k: next(i for i, ln in enumerate(lines) if ln.startswith(k)) for k in ("READY=1", "STATUS=", "STOPPING=1")}
    assert first["READY=1"] < first["STATUS="] < first["STOPPING=1"], lines
    assert "active=" in next(ln for ln in lines if ln.startswith("STATUS="))


def test_top_once_prints_a_snapshot(tiny_model):
    with NodeProcess(tiny_model) as n:
        with n.client() as c:
            c.generate("x", tokens=[3, 4, 5], max_tokens=4)
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "top"), "--connect", n.telemetry, "--once"],
                             capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for word in ("meshnode", "recipe mn1-", "KV", "scratch", "memory", "sessions active", "batch",
                 "tokens/s", "rejected", "engine pid", "wait p50"):
        assert word in out.stdout


@pytest.mark.slow
def test_top_once_without_a_node_says_so(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "top"), "--connect",
                          f"ipc://{tmp_path}/none.sock", "--once", "--timeout", "1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "no telemetry" in out.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_top_in_tmux_like_a_person(tiny_model, tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    ep = f"ipc://{run_dir}/telemetry.sock"
    name = f"mntop{os.getpid()}"

    def screen():
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True).stdout

    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "100", "-y", "30",
                    f"{sys.executable} {ROOT}/tools/top --connect {ep}"], check=True)
    try:
        assert wait_until(lambda: "waiting for node" in screen(), 10)
        with NodeProcess(tiny_model, run_dir=run_dir):
            assert wait_until(lambda: "sessions active" in screen() and "cache    client" in screen(), 15), screen()
            subprocess.run(["tmux", "resize-window", "-t", name, "-x", "70", "-y", "25"])
            assert wait_until(lambda: "sessions active" in screen() and len(screen().splitlines()[0]) <= 70, 15)
            subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)
            assert wait_until(lambda: subprocess.run(["tmux", "has-session", "-t", name],
                                                     capture_output=True).returncode != 0, 10)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def test_metrics_endpoint_serves_prometheus_text(tiny_model):
    port = free_tcp_port()
    with NodeProcess(tiny_model, "--metrics-listen", f"127.0.0.1:{port}") as n:
        with n.client() as c:
            c.generate("m", tokens=[3, 4, 5], max_tokens=3)
            c.submit("bad", tokens=[3], max_tokens=10**6)
            c.wait_for(lambda e: e["event"] == "rejected")
        def scrape():
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return {name: float(value) for name, value in
                    (ln.rsplit(" ", 1) for ln in body.splitlines() if ln and not ln.startswith("#"))}

        # the text is rendered once per telemetry publication (every second), not per scrape
        samples = wait_until(lambda: (lambda s: s if s["meshnode_generation_tokens_total"] >= 3 else None)(scrape()),
                             60)
    assert samples, "the scrape never showed the generated tokens"
    assert samples['meshnode_requests_rejected_total{reason="REJECTED_CONTEXT_TOO_LONG"}'] == 1
    assert "meshnode_kv_cache_usage_ratio" in samples and "meshnode_engine_restarts_total" in samples
    # what clients feel, as histograms: one session's first token, its two gaps, its queue and its whole time
    assert samples["meshnode_time_to_first_token_seconds_count"] == 1
    assert samples["meshnode_inter_token_latency_seconds_count"] == 2
    assert samples["meshnode_request_queue_time_seconds_count"] == samples["meshnode_e2e_request_latency_seconds_count"] == 1
    assert samples['meshnode_time_to_first_token_seconds_bucket{le="+Inf"}'] == 1


def test_metrics_carry_the_model_server_protocols_names_for_routers(tiny_model):
    """vLLM's names with vLLM's meanings, read as the inference extension reads them: while one session runs
    and one waits (max_active 1), running 1 and waiting 1, and the KV usage is what admission handed out."""
    port = free_tcp_port()
    # a tick takes at least 5 ms and one token (the faults' slow engine): `a` runs for 20 s or more while `b`
    # waits (the tiny model alone decodes 4000 tokens in about a second, and the scrape then saw neither)
    with NodeProcess(tiny_model, "--metrics-listen", f"127.0.0.1:{port}", "--max-active", "1", "--decode-steps-ms",
                     "0", internal={"faults": [{"step_sleep_s": 0.005}]}) as n, n.client() as c:
        for sid in ("a", "b"):
            c.submit(sid, tokens=prompt(8), max_tokens=4000, ignore_eos=True)
        c.wait_for(lambda e: e["event"] == "admitted" and e["id"] == "b")
        url = f"http://127.0.0.1:{port}/metrics"
        text = wait_until(lambda: (lambda t: t if 'vllm:num_requests_waiting{model_name="tiny.gguf"} 1.0' in t
                                   else None)(urllib.request.urlopen(url, timeout=5).read().decode()), 30)
        assert text, "the scrape never showed the waiting session"
        info = assert_routable(text, "tiny.gguf", running=1, waiting=1)
        st = c.status()
        kv = st["telemetry"]["kv_pressure"]
        assert abs(router_metrics(text)["vllm:kv_cache_usage_perc"][1][0][1] - kv) < 1e-3 and kv > 0
        budget = st["node"]["budgets"]
        assert int(info["num_gpu_blocks"]) == budget["kv_budget_bytes"] // budget["kv_bytes_per_token"] // 16
        assert info["enable_prefix_caching"] == "True" and info["cache_dtype"] == "f16"
        for sid in ("a", "b"):
            c.cancel(sid)
