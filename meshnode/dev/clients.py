"""Clients that misbehave on purpose, for tests and the abuse bench."""
from __future__ import annotations

import zmq


def deaf_client(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER with the smallest receive buffers: a client that reads nothing fills the node's queue to
    it quickly."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(endpoint)
    return s
