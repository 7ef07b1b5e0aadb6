"""`serve --http`: the OpenAI gateway (meshnode/gateway) as the node's child process, a client of the node
like any other. The node starts it once it serves, restarts it when it exits (backing off from 1 s to
30 s, so a gateway that cannot start does not spin), keeps it through a drain (its streams end with their
sessions; one that exits then is not restarted) and stops it at shutdown, before the engine."""
from __future__ import annotations

import logging
import subprocess
import sys

log = logging.getLogger("meshnode.front")
BACKOFF_S = (1.0, 30.0)
STOP_WAIT_S = 5.0


class GatewayChild:
    def __init__(self, http: str, node_endpoint: str, model: str, api_key_file: str | None, insecure: bool,
                 cors_origins: str | None = None, model_name: str | None = None, sampling_defaults: str | None = None,
                 model_tags: str | None = None, metrics: bool = True, reasoning_format: str = "auto"):
        for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):  # a bind address: connect on loopback
            node_endpoint = node_endpoint.replace(wildcard, "tcp://127.0.0.1:")
        self.cmd = [sys.executable, "-m", "meshnode", "gateway", "--listen", http, "--node", node_endpoint,
                    "--model", model, *(["--api-key-file", api_key_file] if api_key_file else []),
                    *(["--insecure"] if insecure else []),
                    *(["--cors-origins", cors_origins] if cors_origins else []),
                    *(["--served-model-name", model_name] if model_name else []),
                    *(["--sampling-defaults", sampling_defaults] if sampling_defaults else []),
                    *(["--served-model-tags", model_tags] if model_tags else []),
                    *([] if metrics else ["--no-metrics"]), "--reasoning-format", reasoning_format]
        self.proc: subprocess.Popen | None = None
        self.backoff = BACKOFF_S[0]
        self.next_start = self.started_at = 0.0
        self.starts = 0

    def check(self, now: float) -> None:
        """Start it, or start it again once its backoff has passed; called every loop turn."""
        if self.proc is not None:
            code = self.proc.poll()
            if code is None:
                return
            if now - self.started_at > 60.0:  # it ran a good while: this is no start-up failure
                self.backoff = BACKOFF_S[0]
            log.warning("the HTTP gateway exited with %s; starting it again in %.0f s", code, self.backoff)
            self.proc, self.next_start = None, now + self.backoff
            self.backoff = min(BACKOFF_S[1], self.backoff * 2)
        if now >= self.next_start:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL)
            self.started_at = now
            self.starts += 1

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
