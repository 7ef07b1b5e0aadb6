"""HOST:PORT, as ggml's RPC endpoints are written: parsed in one place for the config, the engine and
the probes. Pure."""
from __future__ import annotations


def host_port(endpoint: str) -> tuple[str, int]:
    """(host, port), an IPv6 host given in brackets; ValueError naming the endpoint."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{endpoint!r} is not HOST:PORT with a port in [1, 65535]")
    return host, int(port)


def hosts_port(endpoint: str) -> tuple[list[str], int]:
    """HOST[,HOST...]:PORT -> (hosts, port): one port on several addresses, as llama-server's `--host
    127.0.0.1,::1` (an IPv6 host bare or in brackets); ValueError naming the endpoint."""
    head, _, port = endpoint.rpartition(":")
    hosts = [h.strip().strip("[]") for h in head.split(",")]
    if not all(hosts) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{endpoint!r} is not HOST[,HOST...]:PORT with a port in [1, 65535]")
    return hosts, int(port)
