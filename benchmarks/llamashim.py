"""llama-server's command line, served by `meshnode serve --http`: what `python -m benchmarks llamatests` puts
where llama.cpp's server tests start llama-server (their LLAMA_SERVER_BIN_PATH).

The flags with a meaning here become the node's (address, model, context, slots, API key, pooling, CORS,
threads, KV types); the others are named on stderr and dropped: the tests that need them (a LoRA, a draft
model, llama-server's own endpoints) fail, and the pass table says which. The node's endpoints are this
process's own (ipc in a fresh folder), so nodes started one after another never meet.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

BOOLEAN = {"--cont-batching", "--embedding", "--embeddings", "--reranking", "--metrics", "--kv-unified",
           "--swa-full", "--slots", "--no-slots", "--verbose", "--context-shift", "--no-ui", "--no-models-autoload",
           "--jinja", "--no-jinja", "--offline", "--no-mmproj", "--no-cache-idle-slots", "--ui-mcp-proxy",
           "--backend_sampling"}
SAME = {"--model": "--model", "-m": "--model", "--pooling": "--pooling", "--cors-origins": "--http-cors-origins",
        "--threads": "--threads", "-t": "--threads", "-ctk": "--type-k", "-ctv": "--type-v",
        "--ctx-size": "--ctx", "-c": "--ctx", "--alias": "--served-model-name", "-a": "--served-model-name",
        "--tags": "--served-model-tags"}
SAMPLING = {"--temp": "temperature", "--seed": "seed", "-s": "seed", "--top-k": "top_k", "--top-p": "top_p",
            "--min-p": "min_p"}
# llama-server's habits where no flag says otherwise: a context of 4096 cells, 4 slots sharing it
DEFAULTS = {"--ctx": "4096", "--n-seq-max": "4", "--max-active": "4"}


def translate(argv: list[str], home: str) -> tuple[list[str], list[str]]:
    """llama-server's arguments -> (meshnode serve's, the flags dropped)."""
    given, dropped, sampling, i, metrics = {}, [], {}, 0, False
    while i < len(argv):
        flag = argv[i]
        value = None if flag in BOOLEAN or i + 1 >= len(argv) else argv[i + 1]
        i += 1 if value is None else 2
        if flag in SAME:
            given[SAME[flag]] = value
        elif flag in ("--parallel", "-np"):
            given["--n-seq-max"] = given["--max-active"] = value
        elif flag in SAMPLING:  # llama-server's server-wide defaults: the gateway's --sampling-defaults
            if not (SAMPLING[flag] == "seed" and int(value) < 0):  # seed -1: llama-server's random one, the default
                sampling[SAMPLING[flag]] = float(value) if SAMPLING[flag] not in ("seed", "top_k") else int(value)
        elif flag == "--metrics":  # llama-server serves /metrics only with it; the node's gateway unless told not to
            metrics = True
        elif flag in ("--host", "--port"):
            given[flag] = value
        elif flag == "--api-key":
            path = os.path.join(home, "api-keys")
            with open(path, "w") as f:
                f.write(value + "\n")
            given["--http-api-key-file"] = path
        else:
            dropped.append(flag if value is None else f"{flag} {value}")
    if sampling:
        given["--http-sampling-defaults"] = json.dumps(sampling)
    http = f"{given.pop('--host', '127.0.0.1')}:{given.pop('--port', '8080')}"
    args = {**DEFAULTS, **given, "--http": http, "--listen": f"ipc://{home}/node.sock",
            "--telemetry": f"ipc://{home}/telemetry.sock", "--drain-timeout-s": "1", "--log-level": "WARNING"}
    return [x for k, v in args.items() for x in (k, v)] + ([] if metrics else ["--no-http-metrics"]), dropped


def main() -> None:
    home = tempfile.mkdtemp(prefix="llamashim-")
    args, dropped = translate(sys.argv[1:], home)
    if dropped:
        print(f"llamashim: dropped {' '.join(dropped)}", file=sys.stderr)
    print(f"llamashim: meshnode serve {' '.join(args)}", file=sys.stderr)
    here = os.path.dirname(os.path.abspath(__file__))  # on the suite's path for its plugin; its ipc.py is not ours
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != here]
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), *path])
    os.execvp(sys.executable, [sys.executable, "-m", "meshnode", "serve", *args])


if __name__ == "__main__":
    main()
