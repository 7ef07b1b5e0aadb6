"""`/metrics` for Prometheus: the telemetry snapshot in text exposition, stdlib only.

The server thread only reads a snapshot through a callback that the front
guards with the scheduler's lock, so scrapes never race the tick loop.
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from meshnode.telemetry import to_prometheus


class MetricsServer:
    def __init__(self, listen: str, snapshot):
        host, _, port = listen.rpartition(":")
        snap = snapshot

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics lives here")
                    return
                body = to_prometheus(snap()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
