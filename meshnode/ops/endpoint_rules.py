"""The settings' rules about where the node can be reached: CURVE files, the metrics and HTTP addresses, and the
rule the sockets enforce when they bind (ipc/transport.py), all applied before anything starts."""
from __future__ import annotations

import os

from meshnode.core.types import ConfigError


def check_endpoints(cfg) -> None:
    """ConfigError naming the first setting that breaks a rule."""
    if (cfg.curve_secret_key is None) != (cfg.curve_allow_dir is None):
        raise ConfigError("curve_secret_key and curve_allow_dir must be given together")
    if cfg.curve_secret_key is not None and not os.path.isfile(cfg.curve_secret_key):
        raise ConfigError(f"curve_secret_key: no such file {cfg.curve_secret_key}")
    if cfg.curve_allow_dir is not None and not os.path.isdir(cfg.curve_allow_dir):
        raise ConfigError(f"curve_allow_dir: no such directory {cfg.curve_allow_dir}")
    if cfg.metrics_listen is not None:
        host, _, port = cfg.metrics_listen.rpartition(":")
        if not (host and port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError(f"metrics_listen: must be HOST:PORT with a port in [1, 65535], "
                              f"got {cfg.metrics_listen!r}")
    from ipc.transport import EndpointError, api_keys, check_private, exposure

    if cfg.http is not None:
        if cfg.curve_secret_key is not None:
            raise ConfigError("http: the gateway child cannot reach a CURVE node; run `meshnode gateway` with its "
                              "--curve-server-key and --curve-client-cert instead")
        from meshnode.core.endpoints import hosts_port
        from meshnode.core.types import sampling_defaults

        for key, check in (("http", hosts_port), ("http_sampling_defaults", sampling_defaults)):
            try:
                check(getattr(cfg, key))
            except ValueError as e:
                raise ConfigError(f"{key}: {e}") from None
        if cfg.http_api_key_file is not None:
            try:
                api_keys(cfg.http_api_key_file)
            except FileNotFoundError:
                raise ConfigError(f"http_api_key_file: no such file {cfg.http_api_key_file}") from None
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise ConfigError(f"http_api_key_file: {e}") from None
        why = exposure(f"tcp://{cfg.http}")
        if why and cfg.http_api_key_file is None and not cfg.insecure:
            raise ConfigError(f"http: refusing to serve HTTP on {cfg.http} without API keys: {why}; set "
                              "http_api_key_file or insecure")

    for key, ep, what in (("listen", cfg.listen, "client"), ("telemetry", cfg.telemetry, "telemetry"),
                          ("kv_events", cfg.kv_events, "kv events"),
                          ("metrics_listen", cfg.metrics_listen and f"tcp://{cfg.metrics_listen}", "metrics")):
        try:  # the rule the sockets enforce when they bind, applied before anything starts
            if ep:
                check_private(ep, what, cfg.curve_secret_key is not None and what != "metrics", cfg.insecure)
        except EndpointError as e:
            raise ConfigError(f"{key}: {e}") from None
