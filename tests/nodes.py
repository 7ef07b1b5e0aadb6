"""Helpers for tests that run real nodes."""
import os
import time

import psutil

from ipc.shm import leftover_segments


def children_of(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_until(pred, timeout_s=10.0, every_s=0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    return pred()


def assert_clean(node, before_segments):
    """After a node stops: exit 0, no child left, no new shm segment, no socket file."""
    assert node.proc.returncode == 0, node.log()
    new = set(leftover_segments()) - set(before_segments)
    assert not new, f"shared memory left behind: {new}"
    left = [f for f in os.listdir(node.run_dir) if f.endswith(".sock") or f.endswith(".lock")]
    assert not left, f"files left in the run dir: {left}"
