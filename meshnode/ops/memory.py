"""Process and host memory, cgroup-aware.

psutil reads /proc/meminfo and ignores a cgroup limit (psutil #2100): under a
systemd MemoryMax= the host may look empty while the node is about to be
OOM-killed. So when our cgroup (v2) has a finite memory.max, available memory
is that limit minus memory.current; otherwise psutil's host figure.
"""
from __future__ import annotations

import os

import psutil


def _cgroup_dir() -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and parts[0] == "0":
                    return "/sys/fs/cgroup" + parts[2]
    except OSError:
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            v = f.read().strip()
        return None if v == "max" else int(v)
    except (OSError, ValueError):
        return None


def host_memory() -> tuple[int, int]:
    """(available, total) bytes for this process: the cgroup's when limited, else the host's."""
    vm = psutil.virtual_memory()
    d = _cgroup_dir()
    if d:
        limit, current = _read_int(os.path.join(d, "memory.max")), _read_int(os.path.join(d, "memory.current"))
        if limit is not None and current is not None and limit < vm.total:
            return max(0, limit - current), limit
    return int(vm.available), int(vm.total)


def rss(pid: int | None = None) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, OSError):
        return 0
