"""systemd's sd_notify without a dependency: one AF_UNIX datagram to $NOTIFY_SOCKET.

The variables are taken out of the environment when read, so the engine
process (spawned later) never inherits them and cannot speak for the unit.
"""
from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, environ=os.environ):
        self.addr = environ.pop("NOTIFY_SOCKET", None)
        usec = environ.pop("WATCHDOG_USEC", None)
        environ.pop("WATCHDOG_PID", None)
        self.watchdog_s = int(usec) / 1e6 if usec and usec.isdigit() else 0.0
        if self.addr and self.addr.startswith("@"):  # abstract namespace
            self.addr = "\0" + self.addr[1:]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self.addr else None

    def notify(self, *lines: str) -> bool:
        if self.sock is None:
            return False
        try:
            self.sock.sendto("\n".join(lines).encode(), self.addr)
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
