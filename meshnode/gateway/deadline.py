"""A deadline for a request's headers, which aiohttp's server does not have.

aiohttp waits for ever for a request line and headers that trickle in: 200 connections sending a byte a
second held the gateway's connections for as long as they liked (slowloris). Each connection's protocol is
wrapped: from its first byte (after connecting, or after the previous request was handled) its headers must
be complete within `header_s`, or the connection is closed. Whether the headers are complete is aiohttp's to
say: the middleware `started` marks it when the request reaches the application, and `handled` when its
answer is written, so a body that happens to hold a blank line never confuses the wrapper.
"""
from __future__ import annotations

import asyncio

HEADER_S = 10.0  # a request's line and headers must arrive within this long of its first byte


class Deadline(asyncio.Protocol):
    def __init__(self, inner: asyncio.Protocol, header_s: float = HEADER_S):
        self.inner, self.header_s = inner, header_s
        self.transport = None
        self.timer: asyncio.TimerHandle | None = None
        self.in_request = False  # headers complete, the application has the request

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._arm()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.timer is None and not self.in_request:
            self._arm()
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def started(self) -> None:
        self.in_request = True
        self._disarm()

    def handled(self) -> None:
        self.in_request = False

    def _arm(self) -> None:
        self.timer = asyncio.get_running_loop().call_later(self.header_s, self._expire)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self) -> None:
        self.timer = None
        if not self.in_request and self.transport is not None:
            self.transport.close()


def wrapper_of(transport) -> Deadline | None:
    """The deadline of the connection `transport` carries: the protocol the server gave it."""
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, Deadline) else None


async def serve(runner, host: str | list[str], port: int, header_s: float = HEADER_S):
    """The runner's application on HOST:PORT, every connection under the header deadline (what
    web.TCPSite would start, with the protocol wrapped)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Deadline(runner.server(), header_s), host, port, reuse_address=True)
