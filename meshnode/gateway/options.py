"""`meshnode gateway`'s flags and the checks made before anything starts (no aiohttp here: the command line
is built without it)."""
from __future__ import annotations

from ipc.transport import exposure
from meshnode.core.endpoints import hosts_port
from meshnode.gateway.deadline import HEADER_S
from meshnode.gateway.reasoning import FORMATS


def add_args(p) -> None:
    p.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT", help="where the HTTP API listens "
                   "(HOST,HOST:PORT: on several addresses, e.g. 127.0.0.1,::1:8080)")
    p.add_argument("--node", help="the node's client endpoint (default: the default serve endpoint)")
    p.add_argument("--api-key-file", help="accepted API keys, one per line (Authorization: Bearer KEY)")
    p.add_argument("--insecure", action="store_true", help="a non-loopback address without API keys")
    p.add_argument("--model", help="the GGUF the node serves, for token names in logprobs (default: the "
                   "node's model path, where this host can read it)")
    p.add_argument("--served-model-name", help="the model's name in /v1/models and in answers (default: the GGUF's "
                   "file name); several, comma-separated: the first in alphabetical order is its id, all are its "
                   "aliases (llama-server's --alias); requests may name any model")
    p.add_argument("--served-model-tags", help="tags /v1/models lists for the model, comma-separated "
                   "(llama-server's --tags)")
    p.add_argument("--no-metrics", action="store_true", help="/metrics answers 501 (llama-server without --metrics)")
    p.add_argument("--reasoning-format", choices=FORMATS, default="auto", help="a reasoning model's <think> thought: "
                   "auto or deepseek (the same here) parse it out of the answer into reasoning_content, none leaves it "
                   "in the text (llama-server's --reasoning-format; a request's reasoning_format overrides it)")
    p.add_argument("--sampling-defaults", metavar="JSON", help="sampling options a request leaves out, by OpenAI's "
                   "names, e.g. '{\"temperature\": 0.8, \"seed\": 42}' (llama-server's --temp and --seed, vLLM's "
                   "generation config; default: OpenAI's temperature 1 and a random seed)")
    p.add_argument("--metrics-from", help="the node's /metrics URL, served again at /metrics (default: the node's "
                   "own text, asked over its protocol)")
    p.add_argument("--cors-origins", help="web origins beside this host's (localhost, 127.0.0.1, [::1]) whose pages "
                   "may call the API, comma-separated, or * for any")
    p.add_argument("--header-timeout-s", type=float, default=HEADER_S, help="a request's line and headers must "
                   "arrive within this long of its first byte, or the connection is closed (slow clients)")
    p.add_argument("--curve-server-key", help="the node's public certificate, for a CURVE node")
    p.add_argument("--curve-client-cert", help="this gateway's secret certificate, for a CURVE node")


def refusal(listen: str, keys: set[bytes], insecure: bool) -> str:
    """Why the gateway must not listen there ("" when it may), in one line with the fix."""
    try:
        hosts_port(listen)
    except ValueError as e:
        return f"--listen: {e}"
    why = exposure(f"tcp://{listen}")
    if why and not keys and not insecure:
        return (f"refusing to serve HTTP on {listen} without API keys: {why}; give --api-key-file (clients send "
                "Authorization: Bearer KEY) or --insecure")
    return ""
