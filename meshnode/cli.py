"""`meshnode` command line: make-model, serve, rpc-worker, gateway, dynamo-worker, generate, top, sweep, bench."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


def cmd_config_example(a) -> int:
    from meshnode.ops.flags import example_file

    sys.stdout.write(example_file())
    return 0


def cmd_serve(a) -> int:
    from meshnode.front.command import serve_node

    return serve_node(a)


def cmd_make_model(a) -> int:
    from meshnode.engine.llamacpp import file_digest
    from meshnode.ops.models import make_model

    path = make_model(a.out, a.preset, a.seed, a.quant)
    print(f"wrote {path} ({path.stat().st_size} bytes, sha256 {file_digest(path)[:16]})")
    return 0


def cmd_generate(a) -> int:
    from ipc.transport import client_curve, default_listen
    from meshnode.client import Client
    from meshnode.core.types import Sampling

    tokens = [int(t) for t in a.tokens.split(",")] if a.tokens else None
    messages = None
    if a.messages:
        with open(a.messages) as f:
            messages = json.load(f)
    sampling = Sampling(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Sampling) if f.name != "logprobs"})
    as_text = tokens is None
    with Client(a.connect or default_listen(), timeout_s=a.timeout,
                **client_curve(a.curve_server_key, a.curve_client_cert)) as c:
        c.submit("gen-1", tokens=tokens, text=a.text, messages=messages, max_tokens=a.max_tokens, sampling=sampling,
                 ignore_eos=a.ignore_eos, stop=a.stop, logprobs=a.logprobs)
        while True:
            ev = c.recv()
            if ev is None:
                print("\nmeshnode generate: no answer from the node", file=sys.stderr)
                return 1
            kind = ev["event"]
            if kind == "rejected" or kind == "error":
                print(f"{kind}: {ev.get('reason') or ev.get('code')}: {ev.get('detail')}", file=sys.stderr)
                return 1
            if kind == "tokens":
                sys.stdout.write(ev["text"] if as_text else " ".join(map(str, ev["tokens"])) + " ")
                for lp in ev.get("logprobs", []):
                    top = " ".join(f"{t['token']}:{t['logprob']:.3f}" for t in lp["top"])
                    print(f"\n  [{lp['token']} {lp['logprob']:.3f} | {top}]", file=sys.stderr)
                sys.stdout.flush()
            if kind == "done":
                print(f"\n[{ev['reason']}] {ev['usage']}", file=sys.stderr)
                return 0


def cmd_top(a) -> int:
    from meshnode.ops.top import main as top_main

    return top_main(a)


def cmd_bench(a) -> int:
    from meshnode import bench

    return bench.run(a)


def cmd_rpc_worker(a) -> int:
    from meshnode.ops.rpcworker import main as worker_main

    code = worker_main(a)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # ggml's server thread has no stop call: the process ends with it


def cmd_dynamo_worker(a) -> int:
    from meshnode.mesh.dynamo_worker import main as worker_main

    return worker_main(a)


def cmd_gateway(a) -> int:
    from meshnode.gateway.server import main as gateway_main

    return gateway_main(a)


def cmd_sweep(a) -> int:
    from meshnode.bench.sweep import main as sweep_main

    return sweep_main(a)


class Parser(argparse.ArgumentParser):
    """A bad flag is one line naming it, like every other refused setting, not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (--help lists the flags)\n")


def _generate_args(p: argparse.ArgumentParser) -> None:
    from meshnode.core.types import Sampling

    p.add_argument("--connect", help="node endpoint (default: the default serve endpoint)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text")
    g.add_argument("--tokens", help="comma-separated token ids")
    g.add_argument("--messages", help="a JSON file: [{\"role\": ..., \"content\": ...}], in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stop", action="append", help="a stop string (repeat for up to 8)")
    p.add_argument("--logprobs", type=int, default=0, help="print each token's logprob and this many alternatives")
    for f in dataclasses.fields(Sampling):  # the sampling fields and their defaults, from their one home
        if f.name != "logprobs":
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--curve-server-key", help="the node's public certificate, for a CURVE node")
    p.add_argument("--curve-client-cert", help="this client's secret certificate, for a CURVE node")


def build_parser() -> argparse.ArgumentParser:
    from meshnode.ops.models import PRESETS, QUANTS

    ap = Parser(prog="meshnode", description="node-local continuous-batching LLM serving")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser)

    p = sub.add_parser("make-model", help="write a deterministic demo Llama GGUF")
    p.add_argument("out")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", choices=sorted(QUANTS), help="quantize with llama.cpp's own quantizer")
    p.set_defaults(fn=cmd_make_model)

    from meshnode.front.command import add_args as serve_args
    p = sub.add_parser("serve", help="run a node (front + engine process)")
    serve_args(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("config-example", help="print every serve setting as a commented TOML file")
    p.set_defaults(fn=cmd_config_example)

    p = sub.add_parser("generate", help="stream one generation from a node")
    _generate_args(p)
    p.set_defaults(fn=cmd_generate)

    from meshnode.ops.top import add_args as top_args
    p = sub.add_parser("top", help="live terminal telemetry viewer")
    top_args(p)
    p.set_defaults(fn=cmd_top)

    from meshnode.ops.rpcworker import add_args as rpc_worker_args
    p = sub.add_parser("rpc-worker", help="serve this host's devices to a node over ggml's RPC backend")
    rpc_worker_args(p)
    p.set_defaults(fn=cmd_rpc_worker)

    from meshnode.gateway.options import add_args as gateway_args
    p = sub.add_parser("gateway", help="the OpenAI HTTP API in front of a node (a client of it)")
    gateway_args(p)
    p.set_defaults(fn=cmd_gateway)
    from meshnode.mesh.options import add_args as worker_args
    p = sub.add_parser("dynamo-worker", help="a node as an NVIDIA Dynamo worker (pip install 'meshnode[dynamo]')")
    worker_args(p)
    p.set_defaults(fn=cmd_dynamo_worker)

    from meshnode.bench.sweep import add_args as sweep_args
    p = sub.add_parser("sweep", help="concurrency sweep through real nodes")
    sweep_args(p)
    p.set_defaults(fn=cmd_sweep)

    from meshnode.bench import add_args as bench_args
    p = sub.add_parser("bench", help="benchmark harnesses: overhead, peers, burst, scale, gateway, memory")
    bench_args(p)
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        from meshnode.front import signals

        signals.install()  # before the parser's imports: a SIGTERM at any moment of start-up is a clean stop
    a = build_parser().parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
