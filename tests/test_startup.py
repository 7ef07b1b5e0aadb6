"""Start-up and shutdown edges: leftovers after a killed front, signals while loading."""
import os
import signal
import subprocess

import pytest

from helpers import children_of, engine_config, serve, wait_until
from ipc.shm import leftover_segments
from meshnode.dev.nodeproc import NodeProcess


# -- leftovers and signals at start -------------------------------------------------------------------
def run_files(run_dir):
    return sorted(f for f in os.listdir(run_dir) if f.endswith((".sock", ".lock")))


def test_a_front_killed_after_a_crash_loop_leaves_nothing(tiny_model):
    """No engine is left to clean up after a front in a crash loop: its reaper does."""
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
    assert wait_until(lambda: not leftover_segments(n.proc.pid), 3)


def test_a_second_node_refused_at_its_second_endpoint_leaves_nothing_of_its_own(tiny_model, tmp_path):
    with NodeProcess(tiny_model) as a:
        out = serve(tiny_model, "--listen", f"ipc://{tmp_path}/b.sock", "--telemetry", a.telemetry)
        assert out.returncode == 1 and "in use by another meshnode" in out.stderr
        assert run_files(tmp_path) == []  # b.sock.lock was taken, then released with the refusal
        with a.client() as c:
            assert c.ping()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_is_a_clean_stop(tiny_model, sig):
    n = NodeProcess(tiny_model, internal={"faults": [{"sleep_at_start": 30}]})
    n._log = open(n.log_path, "w")
    n.proc = subprocess.Popen(n.args, env=n.env, stdout=n._log, stderr=subprocess.STDOUT)
    assert wait_until(lambda: children_of(n.proc.pid), 20)  # the engine is loading (for 30 s): the front waits
    n.proc.send_signal(sig)
    assert n.proc.wait(15) == 0, n.log()
    n._log.close()
    assert "Traceback" not in n.log() and "stopped by a signal during start-up" in n.log()
    assert wait_until(lambda: not run_files(n.run_dir), 3) and not leftover_segments(n.proc.pid)


# -- settings that only fail once tried: one line, exit 2, at once -------------------------------------
def test_a_metrics_port_in_use_ends_the_start_in_one_line(tiny_model, tmp_path):
    """The port is bound before the engine loads the model, and a failed bind closes the sockets
    already made: it used to leave the zmq context waiting for ever, with no output and no exit."""
    import socket

    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    out = serve(tiny_model, "--metrics-listen", f"127.0.0.1:{port}", "--listen", f"ipc://{tmp_path}/n.sock",
                "--telemetry", f"ipc://{tmp_path}/t.sock", timeout=60)
    taken.close()
    lines = [ln for ln in out.stderr.splitlines() if "cannot serve" in ln]
    assert out.returncode == 2 and len(lines) == 1 and f"metrics_listen: cannot listen on 127.0.0.1:{port}" in lines[0]
    assert "Traceback" not in out.stderr and run_files(tmp_path) == []


@pytest.mark.parametrize("setting, key", [
    (["--metrics-listen", "127.0.0.1:99999"], "metrics_listen"),
    (["--curve-secret-key", "/nonexistent/server.key_secret", "--curve-allow-dir", "/tmp"], "curve_secret_key"),
    (["--n-batch", "1", "--n-seq-max", "1"], "n_batch"),
    (["--ctx", "1", "--n-seq-max", "1"], "ctx"),
    (["--max-active", "x"], "--max-active: invalid int value"),
    (["--kv-budget-mb", "0.001"], "kv_budget_bytes"),  # a budget too small to hold one token
])
def test_a_setting_that_cannot_work_is_one_line_and_exit_2(tiny_model, tmp_path, setting, key):
    out = serve(tiny_model, *setting, "--listen", f"ipc://{tmp_path}/n.sock", "--telemetry",
                f"ipc://{tmp_path}/t.sock", timeout=60)
    said = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and key in out.stderr, out.stderr
    assert len(said) == 1 or (len([ln for ln in said if "cannot serve" in ln]) == 1 and "Traceback" not in out.stderr)
    assert "usage:" not in out.stderr


def test_calibration_fits_the_smallest_batch_the_config_allows(tiny_model):
    """n_batch 2 with one sequence: every timed chunk fits (it used to send an 8-token chunk)."""
    from meshnode.engine.llama import LlamaEngine

    with LlamaEngine(engine_config(tiny_model, n_seq_max=1, ctx=256, n_batch=2, threads=1)) as e:
        got = e.calibrate()
    assert got and max(row[1] for row in got) <= 2
