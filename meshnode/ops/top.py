"""`tools/top` / `meshnode top`: a live terminal view of a node's telemetry PUB.

Plain curses, so it works over SSH. Every snapshot is complete, so the view
is simply the last one received plus a minute of occupancy history for the
sparkline. `--once` prints one plain-text snapshot for scripts and tests.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import deque

import zmq

from ipc import protocol as P
from ipc.transport import client_curve, default_telemetry, telemetry_sub

SPARK = " ▁▂▃▄▅▆▇█"


def _mb(n) -> str:
    return f"{(n or 0) / 2**20:,.1f} MiB"


def bar(frac: float, width: int) -> str:
    frac = min(1.0, max(0.0, frac or 0.0))
    full = int(round(frac * width))
    return "[" + "#" * full + "." * (width - full) + f"] {frac:6.1%}"


def sparkline(values, top: float) -> str:
    if not values:
        return ""
    top = max(top, 1e-9)
    return "".join(SPARK[min(len(SPARK) - 1, int(round(v / top * (len(SPARK) - 1))))] for v in values)


def _cache_line(c: dict) -> str:
    if c.get("scope", "off") == "off":
        return "cache    off"
    return (f"cache    {c['scope']}  entries {c.get('entries', 0)} ({_mb(c.get('cached_bytes'))})"
            f"  hits {c.get('hits_total', 0):,}  saved {c.get('hit_tokens_total', 0):,} tokens"
            f" ({c.get('hit_token_ratio', 0):.0%})  evictions {c.get('evictions_total', 0):,}")


def render(snap: dict, history, width: int = 80) -> list[str]:
    """The screen as lines of text: the same for curses and for --once."""
    e, m = snap.get("engine", {}), snap.get("memory", {})
    gw = max(10, min(40, width - 32))
    health = "" if snap.get("healthy", True) else "  ENGINE UNHEALTHY"
    if e.get("missing"):
        health += f"  WAITING: {e['missing']}"
    lines = [
        f"meshnode  model {snap.get('model', '?')}  recipe {snap.get('recipe', '?')}{health}",
        f"uptime {snap.get('uptime_s', 0):,.0f} s  engine pid {e.get('pid', 0)}  rss {_mb(e.get('rss_bytes'))}"
        f"  restarts {e.get('restarts', 0)}  last tick {e.get('last_tick_ms', 0):.1f} ms"
        f"  wait p50 {e.get('wait_us_p50', 0):.0f} us{'  DRAINING' if snap.get('draining') else ''}",
        "",
        f"KV       {bar(snap.get('kv_pressure', 0), gw)}  {_mb(snap.get('kv_bytes'))} / {_mb(snap.get('kv_budget_bytes'))}",
        f"scratch  {bar(snap.get('scratch_pressure', 0), gw)}  {_mb(snap.get('scratch_bytes'))} / "
        f"{_mb(snap.get('scratch_budget_bytes'))}",
        f"memory   {bar(m.get('pressure', 0), gw)}  {_mb(m.get('available_bytes'))} available",
        "",
        f"sessions active {snap.get('active_sessions', 0)}   queued {snap.get('queue_depth', 0)}",
        f"batch    now {snap.get('batch_occupancy_last', 0)}  avg {snap.get('batch_occupancy_avg', 0):.2f}"
        f"  max {snap.get('batch_occupancy_max', 0)}   ticks {snap.get('ticks_total', 0):,}",
        f"         {sparkline(list(history)[-(width - 10):], snap.get('max_batch_size') or max(history or [1]))}",
        f"tokens/s prefill {snap.get('prefill_tokens_per_s', 0):,.1f}   decode {snap.get('decode_tokens_per_s', 0):,.1f}"
        f"   (totals {snap.get('prefill_tokens_total', 0):,} / {snap.get('decode_tokens_total', 0):,})",
        _cache_line(snap.get("prefix_cache") or {}),
        "",
        f"rejected {snap.get('rejected_total', 0)}   bad frames {snap.get('bad_frames_total', 0)}"
        f"   client faults {snap.get('client_faults_total', 0)}",
    ]
    for reason, n in sorted((snap.get("rejected_by_reason") or {}).items()):
        if n:
            lines.append(f"  {reason:<28} {n}")
    return [ln[:width] for ln in lines]


def _recv(sock: zmq.Socket) -> dict | None:
    frames = sock.recv_multipart()
    if len(frames) != 2:
        return None
    try:
        snap = P.unpack(frames[1])
    except ValueError:
        return None
    return snap if isinstance(snap, dict) else None


def once(endpoint: str, timeout_s: float, curve: dict) -> int:
    ctx = zmq.Context()
    sock = telemetry_sub(ctx, endpoint, **curve)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(100):
                snap = _recv(sock)
                if snap:
                    print("\n".join(render(snap, [snap.get("batch_occupancy_last", 0)], 100)))
                    return 0
        print(f"no telemetry from {endpoint} within {timeout_s:.0f} s (is the node running?)", file=sys.stderr)
        return 1
    finally:
        sock.close(0)
        ctx.term()


def live(endpoint: str, curve: dict) -> int:
    import curses

    def run(scr) -> None:
        curses.curs_set(0)
        scr.nodelay(True)
        ctx = zmq.Context()
        sock = telemetry_sub(ctx, endpoint, **curve)
        snap, history = None, deque(maxlen=60)
        try:
            while True:
                while sock.poll(0):
                    got = _recv(sock)
                    if got:
                        snap = got
                        history.append(got.get("batch_occupancy_last", 0))
                key = scr.getch()
                if key in (ord("q"), ord("Q")):
                    return
                h, w = scr.getmaxyx()
                scr.erase()
                lines = render(snap, history, w - 1) if snap else [f"waiting for node... ({endpoint})"]
                lines.append("")
                lines.append("q quits")
                for y, ln in enumerate(lines[: h - 1]):
                    scr.addstr(y, 0, ln[: w - 1])
                scr.refresh()
                sock.poll(200)
        finally:
            sock.close(0)
            ctx.term()

    curses.wrapper(run)
    return 0


def main(a) -> int:
    endpoint = a.connect or default_telemetry()
    curve = client_curve(a.curve_server_key, a.curve_client_cert)
    return once(endpoint, a.timeout, curve) if a.once else live(endpoint, curve)


def add_args(ap) -> None:
    ap.add_argument("--connect", help="telemetry endpoint (default: the default `meshnode serve` one)")
    ap.add_argument("--once", action="store_true", help="print one plain-text snapshot and exit")
    ap.add_argument("--timeout", type=float, default=10.0, help="with --once: how long to wait")
    ap.add_argument("--curve-server-key", help="the node's public certificate, for a CURVE node")
    ap.add_argument("--curve-client-cert", help="this client's secret certificate, for a CURVE node")


def cli(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="top", description="live meshnode telemetry viewer")
    add_args(ap)
    return main(ap.parse_args(argv))
