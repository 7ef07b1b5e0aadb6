"""A share of the front's CPU for client requests, so a flood of them cannot starve the decode.

llama.cpp's threads wait for each other at every graph node by spinning, not
sleeping: when the front takes a core answering a flood of valid requests, one
decode thread is descheduled and every barrier waits for it (a step can take
a hundred times its length; docs/architecture.md). So while sessions decode
(an idle engine has nothing to protect) client work is metered like a token
bucket of CPU seconds: it refills at `share` seconds per second up to `burst`,
and while it is empty the front leaves the client socket alone and
the requests wait in the clients' own queues (ZeroMQ's backpressure), while
ticks and replies go on. A request is charged the time the front spent on it
plus what receiving its bytes cost other threads. Pure: the caller passes the
clock.
"""
from __future__ import annotations

SHARE = 0.25  # of one core, for client requests under a flood
BURST_S = 0.025  # a quiet node answers a burst of this much work at once
# what receiving a request's bytes costs besides the front's own thread (ZeroMQ's I/O thread and the
# kernel), per byte: docs/architecture.md says how it was measured
RECEIVE_S_PER_BYTE = 2e-3 / (1 << 20)


class CpuShare:
    def __init__(self, now: float, share: float = SHARE, burst_s: float = BURST_S):
        self.share, self.burst_s = share, burst_s
        self.balance, self._at = burst_s, now

    def available(self, now: float) -> float:
        """Seconds of client work the front may do now."""
        self.balance = min(self.burst_s, self.balance + (now - self._at) * self.share)
        self._at = now
        return max(0.0, self.balance)

    def spend(self, seconds: float) -> None:
        self.balance -= seconds

    def wait_s(self, now: float) -> float:
        """How long until some client work is allowed again (0 when it is now)."""
        return 0.0 if self.available(now) > 0 else -self.balance / self.share
