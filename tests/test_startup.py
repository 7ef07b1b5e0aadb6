"""Start-up and shutdown edges: leftovers after a killed front, signals while loading."""
import os
import signal
import subprocess
import time

import pytest

from helpers import children_of, serve, wait_until
from ipc.shm import leftover_segments
from meshnode.dev.nodeproc import NodeProcess


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
