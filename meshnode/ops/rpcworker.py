"""`meshnode rpc-worker`: ggml's RPC server on this host's devices, so a helper host needs only this
package. A node started with `--rpc HOST:PORT` puts some of the model's layers, and their KV, here.

ggml's RPC protocol has no authentication and lets any client allocate memory and run graphs, so a
non-loopback address is refused unless `--insecure` (run it on a private network or a tunnel). The
server runs on a thread (the ctypes call releases the GIL) so the main thread can take SIGTERM and
exit 0; ggml's server has no stop call, so the process ends with it.
"""
from __future__ import annotations

import logging
import os
import resource
import signal
import sys
import threading
import time

from ipc.transport import exposure, reachable
from meshnode.core.endpoints import host_port

log = logging.getLogger("meshnode.rpc_worker")
READY_WAIT_S = 30.0  # ggml listens within moments of starting; past this the start has failed


def add_args(p) -> None:
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where ggml's RPC server listens")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for the graphs it runs; 0 = all cores")
    p.add_argument("--mem-mb", type=float, default=0, help="most memory the worker may hold for clients (a "
                   "data-segment limit; 0 = no cap). ggml reports the device's own free memory to nodes: set "
                   "--tensor-split on the node where caps differ")
    p.add_argument("--device", default="", help="comma-separated ggml devices to serve (default: this CPU)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback address (no authentication: "
                   "private networks and tunnels only)")


def refusal(a) -> str:
    """Why these arguments cannot serve ("" when they can), in one line with the fix."""
    try:
        host_port(a.listen)
    except ValueError as e:
        return f"--listen: {e}"
    if exposure(f"tcp://{a.listen}") and not a.insecure:
        return (f"refusing to listen on {a.listen}: ggml's RPC protocol has no authentication and runs any "
                "client's graphs; use 127.0.0.1 with a tunnel, or pass --insecure on a private network")
    if a.threads < 0 or a.mem_mb < 0:
        return "--threads and --mem-mb must be >= 0"
    import llama_cpp

    from meshnode.engine.devices import RPC_FIX
    if not llama_cpp.llama_supports_rpc():
        return f"this llama.cpp build has no RPC backend; {RPC_FIX}"
    if not reachable(a.listen, 0.2):
        return f"{a.listen} is in use already"
    return ""


def main(a) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())  # handlers only set a flag
    why = refusal(a)
    if why:
        print(f"meshnode rpc-worker: {why}", file=sys.stderr)
        return 2
    from meshnode.engine import llamacpp
    from meshnode.engine.devices import Registry

    llamacpp.install_log()
    if a.mem_mb:  # on top of what the process holds now and the server thread's stack (mapped when it starts)
        stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
        limit = int(a.mem_mb * 2**20) + _data_in_use() + (stack if 0 < stack < 2**30 else 8 << 20)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    reg = Registry()
    devices = [d for d in a.device.split(",") if d]
    try:
        for d in devices:  # in one line here, not in a thread's traceback
            reg.by_name(d)
    except ValueError as e:
        print(f"meshnode rpc-worker: --{e}", file=sys.stderr)
        return 2
    threads = a.threads or os.cpu_count() or 1
    server = threading.Thread(target=reg.serve_rpc, args=(a.listen, threads, devices), daemon=True,
                              name="ggml-rpc-server")
    server.start()
    deadline = time.monotonic() + READY_WAIT_S
    while reachable(a.listen, 0.2) and server.is_alive() and time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.05)
    if not server.is_alive() or reachable(a.listen, 0.2):
        if stop.is_set():
            return 0
        log.error("ggml's RPC server did not start on %s (see its lines above)", a.listen)
        return 1
    names = devices or ["CPU"]
    log.info("rpc-worker ready: listen=%s devices=%s threads=%d mem_cap=%s pid=%d", a.listen,
             ",".join(f"{n} ({reg.describe(n).mem_total >> 20} MiB)" for n in names), threads,
             f"{a.mem_mb:g} MiB" if a.mem_mb else "none", os.getpid())
    while not stop.wait(0.5):
        if not server.is_alive():
            log.error("ggml's RPC server stopped (see its lines above)")
            return 1
    log.info("rpc-worker stopping (signal)")
    return 0


def _data_in_use() -> int:
    """The process's data segment now (Python, numpy, the ggml libraries): the cap comes on top of it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0
