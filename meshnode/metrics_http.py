"""`/metrics` for Prometheus: the telemetry snapshot in text exposition, stdlib only.

The front's loop renders the text once per telemetry publication and hands it
over; the server thread only writes those bytes. So a scrape never touches the
scheduler, and a flood of scrapes costs the loop nothing but the GIL the
server's one thread takes to parse requests: one request at a time, each with a
short timeout, and at most RATE_PER_S answered per second (the rest get 429).
"""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from meshnode.telemetry import to_prometheus

RATE_PER_S = 20.0  # scrapes answered per second (Prometheus scrapes every few seconds)
TIMEOUT_S = 2.0  # a client that sends its request slower than this is dropped


class MetricsServer:
    def __init__(self, listen: str):
        host, _, port = listen.rpartition(":")
        self._body = b""
        self.refused_total = 0
        server = self
        bucket = {"tokens": RATE_PER_S, "at": time.monotonic()}

        class Handler(BaseHTTPRequestHandler):
            timeout = TIMEOUT_S

            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics lives here")
                    return
                now = time.monotonic()
                bucket["tokens"] = min(RATE_PER_S, bucket["tokens"] + (now - bucket["at"]) * RATE_PER_S)
                bucket["at"] = now
                if bucket["tokens"] < 1:
                    server.refused_total += 1
                    self.send_error(429, "too many scrapes; the metrics change once a second")
                    return
                bucket["tokens"] -= 1
                body = server._body
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = HTTPServer((host or "127.0.0.1", int(port)), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self.thread.start()

    def publish(self, snapshot: dict) -> None:
        """The loop's side: the text every scrape gets until the next publication."""
        self._body = to_prometheus(snapshot).encode()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
