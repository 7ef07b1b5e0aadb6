"""`python -m benchmarks abuse`: the largest valid request of every kind against a node serving 4 streams.

Four sessions stream steadily to one client (each a chain of sessions, the
next submitted as one ends). A second process holds abusers that fire, with a
few requests in flight each, the largest valid request of every kind: 256 KiB
texts of characters the vocab lacks (the tokenizer's worst case) and the
largest text the context bound cannot refuse unread, the same as chat messages
from ten identities, 65,536-token prompts,
status floods, cancels of unknown ids, /metrics scrapes, a client that
submits sessions and stops reading, response_format grammars the constraint
library gives up on while generating, and 1,100 connections that never send a
ZeroMQ greeting. The abusers are switched on and off in
short alternating phases, so both conditions see the streams at the same
context lengths (a tick's cost grows with them); their requests are packed
once, so their own CPU stays small next to what they cost the node. The
streams' token gaps under abuse are compared with the steady ones in the same
run: target worst gap <= 2x the steady p99, no engine restart, and every
admitted session (the abusers' too) gets exactly one `done`. A client of its
own sends a small text every quarter second: how long its first token waits,
steady and under abuse, says whether anyone's tokenization holds it up.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import zmq

from ipc import protocol as P
from ipc import events as E
from ipc.transport import free_tcp_port
from meshnode.bench import llama_build, model_path, token_gaps
from meshnode.dev.clients import deaf_client
from meshnode.dev.nodeproc import NodeProcess
from meshnode.core.types import ResponseFormat, Sampling
from meshnode.engine.llamacpp import system_info

STREAMS = 4
PAIRS = 5  # steady + abuse phase pairs per round
STREAM_TOKENS = 1000  # per session of a stream
WORST_TEXT = "\t" * (256 * 1024)
KINDS = ("text", "chat", "tokens", "status", "cancel", "metrics", "slow_reader", "grammar", "handshake")
# grammars the constraint library compiles, then gives up on a token or two into the answer (its limits): each
# such session must end alone (done BAD_REQUEST) while the streams' ticks go on
FAILING_GRAMMARS = ('root ::= "a" root', "root ::= " + " | ".join(f'"w{i}"' for i in range(2001)))
SILENT_SOCKETS = 1100  # connections that never send a ZeroMQ greeting, held while the abuse is on
CHAT_IDENTITIES = 10  # the chat abuse: ten clients, each with one 256 KiB message of tabs in flight
PROBE_EVERY_S = 0.25  # a small `text` request from a client of its own, steady and under abuse


WINDOW = 8  # requests an abuser keeps in flight: the node always has its next one queued


def _frames(kind: str, n_ctx_seq: int) -> list[list[bytes]]:
    """The requests an abuser cycles through, packed once: the abuser's own CPU must stay small next
    to what it costs the node, or on a small machine it measures its own load instead."""
    if kind == "text":  # the protocol's largest text, and the largest one the bound cannot refuse unread
        return [P.encode_request(P.Submit("t", 1, text=WORST_TEXT)),
                P.encode_request(P.Submit("u", 1, text="\t" * (n_ctx_seq + 1)))]
    if kind == "tokens":
        return [P.encode_request(P.Submit("k", 1, [3 + i % 500 for i in range(65536)]))]
    if kind == "chat":  # the largest message (tabs: llama.cpp's quadratic case) and the largest one unread
        return [P.encode_request(P.Submit("m", 1, messages=[{"role": "user", "content": WORST_TEXT[:-4]}])),
                P.encode_request(P.Submit("n", 1, messages=[{"role": "user", "content": "\t" * (n_ctx_seq + 1)}]))]
    if kind == "status":
        return [P.encode_request(P.Status())]
    if kind == "grammar":
        return [P.encode_request(P.Submit(f"g{k}", 100, [5, 9, 33], sampling=Sampling(1.0, 0, 1.0, k),
                                          response_format=ResponseFormat("grammar", FAILING_GRAMMARS[k % 2])))
                for k in range(2 * WINDOW)]  # ids enough that none is still live when it comes round again
    return [P.encode_request(P.Cancel("no-such-session"))]


def _abuser(kind: str, endpoint: str, metrics_url: str, n_ctx_seq: int, on, stop: threading.Event,
            counts: dict) -> None:
    """Fires while `on` is set, idles while it is not, ends at `stop`."""
    if kind == "metrics":
        return _scraper(metrics_url, on, stop, counts)
    if kind == "handshake":
        return _silent_sockets(endpoint, on, stop, counts)
    if kind == "slow_reader":
        n = 0
        while not stop.is_set():
            if on.wait(0.1):
                n += 1
                _slow_reader(endpoint, n, counts)
        return
    frames = _frames(kind, n_ctx_seq)
    ctx = zmq.Context()
    n_sockets, window = (CHAT_IDENTITIES, 1) if kind == "chat" else (1, WINDOW)
    socks = []
    poller = zmq.Poller()
    for _ in range(n_sockets):  # an identity each: what one client sends is answered in order
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        socks.append([s, 0, 0])  # socket, sent, answered
        poller.register(s, zmq.POLLIN)
    while not stop.is_set():
        for entry in socks:
            while entry[1] - entry[2] < window and on.is_set():
                entry[0].send_multipart(frames[entry[1] % len(frames)], copy=False)
                entry[1] += 1
        ready = dict(poller.poll(200))
        for entry in socks:
            if ready.get(entry[0]):
                ev = E.decode_event(entry[0].recv_multipart())
                if ev["event"] in ("admitted", "tokens"):  # a session's answer is its done
                    continue
                entry[2] += 1
                key = ev.get("reason") or ev.get("code") or ev["event"]
                counts[key] = counts.get(key, 0) + 1
    counts["sent"] = sum(e[1] for e in socks)
    for e in socks:
        e[0].close()
    ctx.term()


def _silent_sockets(endpoint: str, on, stop: threading.Event, counts: dict) -> None:
    """SILENT_SOCKETS plain connections that never send a greeting, opened when the abuse starts and held
    until it ends (the node closes them: at its cap, or at the handshake deadline)."""
    import socket

    from ipc.transport import ipc_path
    from meshnode.core.endpoints import host_port

    path = ipc_path(endpoint)
    where = path or host_port(endpoint[len("tcp://"):])
    held: list = []
    while not stop.is_set():
        if on.wait(0.1) and not held:
            for _ in range(SILENT_SOCKETS):
                s = socket.socket(socket.AF_UNIX) if path else socket.socket()
                try:
                    s.connect(where)
                except OSError:
                    s.close()
                    counts["connect_failed"] = counts.get("connect_failed", 0) + 1
                    continue
                held.append(s)
            counts["sent"] += len(held)
        elif not on.is_set() and held:
            for s in held:
                s.close()
            held = []
    for s in held:
        s.close()


def _scraper(url: str, on, stop: threading.Event, counts: dict) -> None:
    """GET /metrics over a raw socket, one after the other."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    request = f"GET {u.path} HTTP/1.0\r\nHost: {u.hostname}\r\n\r\n".encode()
    while not stop.is_set():
        if not on.wait(0.1):
            continue
        with socket.create_connection((u.hostname, u.port), timeout=5) as c:
            c.sendall(request)
            head = c.recv(64)
            while c.recv(65536):
                pass
        code = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "?"
        counts["sent"] += 1
        counts[f"http_{code}"] = counts.get(f"http_{code}", 0) + 1


def _slow_reader(endpoint: str, n: int, counts: dict) -> None:
    """A client that submits two sessions and then a thousand status requests (answers of a few KiB:
    more than the socket buffers hold), reads nothing for a second, then reads everything: the node
    gives up on its sessions when its queue to the client is full, and each session must still end
    with exactly one done."""
    ctx = zmq.Context()
    s = deaf_client(ctx, endpoint)
    ids = [f"slow{n}-{k}" for k in range(2)]
    for k, sid in enumerate(ids):
        s.send_multipart(P.encode_request(P.Submit(sid, 300, [3 + k, 4, 5], ignore_eos=True)))
    status = P.encode_request(P.Status())
    for _ in range(1200):
        s.send_multipart(status)
    counts["sent"] += len(ids) + 1200
    time.sleep(1.0)
    admitted, done, deadline = set(), {}, time.monotonic() + 120
    while (len(done) < len(admitted) or not admitted) and time.monotonic() < deadline:
        if s.poll(1000):
            ev = E.decode_event(s.recv_multipart())
            if ev["event"] == "admitted":
                admitted.add(ev["id"])
            elif ev["event"] == "done":
                counts["double_done"] = counts.get("double_done", 0) + (ev["id"] in done)
                done[ev["id"]] = ev
            elif ev["event"] == "rejected":
                ids.remove(ev["id"])
                if not ids:
                    break
    counts["admitted"] = counts.get("admitted", 0) + len(admitted)
    counts["done"] = counts.get("done", 0) + len(done)
    s.close()
    ctx.term()


def _abuse_process(endpoint: str, metrics_url: str, n_ctx_seq: int, on, stop_ev, out, kinds=KINDS) -> None:
    """One process for the whole run (an interpreter's start-up is not abuse): fires while `on`."""
    stop = threading.Event()
    counts = {k: {"sent": 0} for k in kinds}
    threads = [threading.Thread(target=_abuser, args=(k, endpoint, metrics_url, n_ctx_seq, on, stop, counts[k]),
                                daemon=True) for k in kinds]
    for t in threads:
        t.start()
    out.put("ready")
    stop_ev.wait()
    stop.set()
    for t in threads:
        t.join(60)
    out.put(counts)


def main(a) -> int:
    path = model_path(a)
    port = free_tcp_port()
    phase_s, rounds = a.phase_s, a.rounds
    # one unified pool of 65,536 cells: the largest texts and chat messages pass the free bound on their token
    # count and are really tokenized (and refused only then), the tokenizer's worst case
    args = ["--max-active", "8", "--kv-layout", "unified", "--ctx", "65536", "--threads", str(a.threads),
            "--metrics-listen", f"127.0.0.1:{port}", "--log-level", "WARNING"]
    rows, ctx = [], mp.get_context("spawn")
    with NodeProcess(path, *args) as node, node.client(timeout_s=120) as c:
        # each stream is a chain of sessions, the next submitted as one ends, so streams outlast any
        # phase length; a gap is measured between two tokens of the same session only
        times: dict[str, list[float]] = {}
        ended: dict[str, dict] = {}
        live = [f"stream{i}-0" for i in range(STREAMS)]
        for i, sid in enumerate(live):
            c.submit(sid, tokens=[3 + i, 4, 5], max_tokens=STREAM_TOKENS, ignore_eos=True)
            times[sid] = []
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set() or any(sid not in ended for sid in live):
                ev = c.recv(0.2)
                if ev is None:
                    continue
                sid = ev.get("id")
                if ev["event"] == "tokens":
                    times[sid].append(time.monotonic())
                elif ev["event"] == "done":
                    ended[sid] = ev
                    if not stop.is_set() and ev["reason"] == "LENGTH":
                        k, gen = sid[len("stream"):].split("-")
                        nxt = f"stream{k}-{int(gen) + 1}"
                        times[nxt] = []
                        live[int(k)] = nxt
                        c.submit(nxt, tokens=[3 + int(k), 4, 5], max_tokens=STREAM_TOKENS, ignore_eos=True)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(2.0)  # all four streaming
        with node.client() as s:
            st = s.status()
            restarts0, n_ctx_seq = st["telemetry"]["engine"]["restarts"], st["node"]["budgets"]["n_ctx_seq"]
        probes: list[tuple[float, float, float]] = []  # (sent, first token wall ms, node-side ttft_ms)
        probe = threading.Thread(target=_probe, args=(node, stop, probes), daemon=True)
        probe.start()
        q, on, stop_abuse = ctx.Queue(), ctx.Event(), ctx.Event()
        p = ctx.Process(target=_abuse_process, args=(node.listen, f"http://127.0.0.1:{port}/metrics", n_ctx_seq,
                                                     on, stop_abuse, q, a.kinds.split(",") if a.kinds else KINDS))
        p.start()
        assert q.get(timeout=120) == "ready"
        time.sleep(1.0)  # its start-up is over
        phases: list[tuple[str, int, float, float]] = []  # (steady|abuse, round, start, end)
        for r in range(rounds):
            for _ in range(PAIRS):
                for kind in ("steady", "abuse"):
                    on.set() if kind == "abuse" else on.clear()
                    t0 = time.monotonic()
                    time.sleep(phase_s)
                    phases.append((kind, r, t0, time.monotonic()))
        on.clear()
        stop_abuse.set()
        counts = q.get(timeout=180)
        p.join(10)
        for r in range(rounds):
            steady = [g for k, rr, lo, hi in phases if k == "steady" and rr == r for g in token_gaps(times, lo, hi)]
            abused = [g for k, rr, lo, hi in phases if k == "abuse" and rr == r for g in token_gaps(times, lo, hi)]
            rows.append({"round": r + 1, "steady_p50_ms": float(np.percentile(steady, 50)),
                         "steady_p99_ms": float(np.percentile(steady, 99)), "steady_max_ms": float(max(steady)),
                         "abuse_p50_ms": float(np.percentile(abused, 50)),
                         "abuse_p99_ms": float(np.percentile(abused, 99)), "abuse_max_ms": float(max(abused)),
                         **_probe_row(probes, phases, r)})
        stop.set()
        for sid in list(live):
            c.cancel(sid)
        reader.join(30)
        probe.join(30)
        with node.client() as s:
            t = s.status()["telemetry"]
    restarts = t["engine"]["restarts"] - restarts0
    slow = counts.get("slow_reader", {})
    lost = slow.get("admitted", 0) - slow.get("done", 0) + sum(sid not in ended for sid in times)
    print(f"model {os.path.basename(path)}: {STREAMS} streams; per round {PAIRS} x ({phase_s:g} s steady, "
          f"{phase_s:g} s abuse); abusers: {', '.join(counts)}; {llama_build()}")
    print(f"llama.cpp system info: {system_info()}")
    print(f"{'round':>6}{'steady p50':>12}{'steady p99':>12}{'steady max':>12}{'abuse p50':>11}{'abuse p99':>11}"
          f"{'abuse max':>11}{'max / steady p99':>18}")
    for r in rows:
        print(f"{r['round']:>6}{r['steady_p50_ms']:12.1f}{r['steady_p99_ms']:12.1f}{r['steady_max_ms']:12.1f}"
              f"{r['abuse_p50_ms']:11.1f}{r['abuse_p99_ms']:11.1f}{r['abuse_max_ms']:11.1f}"
              f"{r['abuse_max_ms'] / r['steady_p99_ms']:17.2f}x")
    print(f"a small text ('hello', 1 token) from a client of its own every {PROBE_EVERY_S:g} s, first token "
          "in ms (wall; node-side ttft_ms, which counts the tokenizer wait):")
    print(f"{'round':>6}{'steady p50':>12}{'steady max':>12}{'abuse p50':>11}{'abuse max':>11}"
          f"{'node ttft max':>15}{'probes':>8}")
    for r in rows:
        print(f"{r['round']:>6}{r['probe_steady_p50_ms']:12.1f}{r['probe_steady_max_ms']:12.1f}"
              f"{r['probe_abuse_p50_ms']:11.1f}{r['probe_abuse_max_ms']:11.1f}{r['probe_abuse_node_ttft_max_ms']:15.1f}"
              f"{r['probes']:>8}")
    print("requests answered, by kind: " + "; ".join(
        f"{k} {v['sent']} sent" + "".join(f", {kk} {vv}" for kk, vv in v.items() if kk != "sent")
        for k, v in counts.items()))
    worst = max(r["abuse_max_ms"] / r["steady_p99_ms"] for r in rows)
    ok = worst <= 2.0 and restarts == 0 and lost == 0 and not slow.get("double_done")
    print(f"worst gap under abuse / steady p99: {worst:.2f}x (target <= 2x); engine restarts {restarts}; "
          f"sessions without their done {lost}: {'met' if ok else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "build": llama_build(), "system_info": system_info(), "phase_s": phase_s, "pairs_per_round": PAIRS, "rows": rows, "requests": counts,
                       "restarts": restarts, "lost": lost, "worst_ratio": worst,
                       "undeliverable_total": t.get("undeliverable_total"), "bad_frames_total": t["bad_frames_total"],
                       "rejected_by_reason": t["rejected_by_reason"]}, f, indent=2)
    return 0


def _probe(node, stop: threading.Event, out: list) -> None:
    """A small request from a client of its own, again and again: how long its first token waits."""
    with node.client(timeout_s=120) as c:
        k = 0
        while not stop.is_set():
            t0 = time.monotonic()
            r = c.generate(f"probe{k}", text="hello", max_tokens=1, ignore_eos=True)
            if r.token_times:
                out.append((t0, (r.token_times[0] - t0) * 1e3, r.done["usage"]["ttft_ms"]))
            k += 1
            stop.wait(PROBE_EVERY_S)


def _probe_row(probes: list, phases: list, r: int) -> dict:
    def within(kind):
        return [p for p in probes for k, rr, lo, hi in phases if k == kind and rr == r and lo <= p[0] < hi]

    steady, abused = within("steady"), within("abuse")
    q = lambda rows, i, f: float(f([p[i] for p in rows])) if rows else float("nan")  # noqa: E731
    return {"probe_steady_p50_ms": q(steady, 1, np.median), "probe_steady_max_ms": q(steady, 1, max),
            "probe_abuse_p50_ms": q(abused, 1, np.median), "probe_abuse_max_ms": q(abused, 1, max),
            "probe_abuse_node_ttft_max_ms": q(abused, 2, max), "probes": len(steady) + len(abused)}
