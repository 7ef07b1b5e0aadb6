"""SIGTERM and SIGINT only count here; the loops read the count (1 = drain, 2 = stop now).

Installed first thing in `meshnode serve`, before the heavy imports and the
model load, so a signal at any point of start-up is a clean stop, never a
traceback or a death by signal.
"""
from __future__ import annotations

import signal

received = 0


def _count(signum, frame) -> None:
    global received
    received += 1


def install() -> None:
    signal.signal(signal.SIGTERM, _count)
    signal.signal(signal.SIGINT, _count)
