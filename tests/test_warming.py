"""The engine process's Warming: a value built on a thread while ticks run; its error reaches the asker."""
import threading

import pytest

from meshnode.worker.warming import Warming


def test_get_waits_for_the_value_built_on_another_thread():
    release, seen = threading.Event(), []

    def build():
        seen.append(threading.current_thread().name)
        release.wait()
        return 42

    w = Warming(build)
    release.set()
    assert w.get() == 42 and seen == ["warming"]
    w.wait()


def test_the_build_error_is_raised_to_whoever_asks_each_time():
    def build():
        raise ValueError("no vocabulary")

    w = Warming(build)
    for _ in range(2):
        with pytest.raises(ValueError, match="no vocabulary"):
            w.get()
