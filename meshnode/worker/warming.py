"""What the engine builds on a thread while it already serves, so that no tick waits for it."""
from __future__ import annotations

import threading


class Warming:
    """One value built on a thread from the engine's start. The structured-output matchers are the one today:
    built at the first constrained session, they held up its tick and every other session's token in it
    (evidence/toolflood-smollm2.txt). `get` waits for the value (and raises what building it raised, where a
    session asks for it); `wait` before the engine is closed, whose model the thread reads."""

    def __init__(self, build):
        self._done, self._value, self._error = threading.Event(), None, None
        self._thread = threading.Thread(target=self._run, args=(build,), name="warming", daemon=True)
        self._thread.start()

    def _run(self, build) -> None:
        try:
            self._value = build()
        except Exception as e:  # noqa: BLE001 - raised to the session that asks for it
            self._error = e
        finally:
            self._done.set()

    def get(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def wait(self) -> None:
        self._thread.join()
