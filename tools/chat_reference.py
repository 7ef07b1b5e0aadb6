#!/usr/bin/env python3
"""Record llama-server's prompt tokens for chat conversations: the reference tests/test_templates.py holds the
node to (its templates must give the same tokens as llama-server's default, Jinja).

For SmolLM2-135M-Instruct (the real model the dev extra installs) and for the tiny BPE demo model carrying
the templates in tests/data/templates/ (Llama 3.1, Qwen2.5, Mistral Nemo, Gemma 2), each conversation in
tests/data/chat-conversations.json (and, for templates with a tool format of their own, each of
tests/data/chat-conversations-tools.json, tools included) goes through llama-server's /apply-template, and the
prompt through its /tokenize with special tokens parsed and BOS added where the vocab wants it: what its
/v1/chat/completions tokenizes. Usage (llama-server built as the README says):

    python tools/chat_reference.py --llama-server PATH   # writes tests/data/chat-reference.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "tests", "data")
NATIVE_TOOLS = ("qwen2.5", "llama-3.1")  # templates whose own tool format the node uses


def models(tmp: str) -> dict[str, str]:
    """label -> GGUF: the real model, and the tiny BPE model once per template file."""
    from meshnode.ops.models import make_model
    from meshnode.ops.realmodel import real_model

    out = {"smollm2": str(real_model("smollm2"))}
    for name in sorted(os.listdir(os.path.join(DATA, "templates"))):
        with open(os.path.join(DATA, "templates", name)) as f:
            source = f.read()
        label = name.removesuffix(".jinja")
        out[label] = str(make_model(os.path.join(tmp, f"{label}.gguf"), "tiny-bpe", 0, chat_template=source))
    return out


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def record(server: str, model: str, conversations: dict) -> dict:
    from ipc.transport import free_tcp_port

    port = free_tcp_port()
    proc = subprocess.Popen([server, "-m", model, "--port", str(port), "--jinja", "-c", "2048", "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        out = {}
        for shape, messages in conversations.items():
            body = messages if isinstance(messages, dict) else {"messages": messages}  # {messages, tools}
            try:
                prompt = post(port, "/apply-template", body)["prompt"]
            except urllib.error.HTTPError:  # the template refused the conversation: so must the node
                out[shape] = None
                continue
            out[shape] = post(port, "/tokenize", {"content": prompt, "add_special": True,
                                                  "parse_special": True})["tokens"]
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", required=True)
    a = p.parse_args()
    with open(os.path.join(DATA, "chat-conversations.json")) as f:
        conversations = json.load(f)
    with open(os.path.join(DATA, "chat-conversations-tools.json")) as f:
        with_tools = json.load(f)  # for the templates with a tool format of their own (meshnode/text/jinja.py)
    with tempfile.TemporaryDirectory() as tmp:
        ref = {label: record(a.llama_server, path, conversations | (with_tools if label in NATIVE_TOOLS else {}))
               for label, path in models(tmp).items()}
    version = subprocess.run([a.llama_server, "--version"], capture_output=True, text=True)
    ref = {"llama_server": (version.stdout + version.stderr).strip().splitlines()[0],
           "date": time.strftime("%Y-%m-%d"), "tokens": ref}  # templates print today's date (Llama 3.1)
    with open(os.path.join(DATA, "chat-reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(f"{sum(len(v) for v in ref['tokens'].values())} conversations recorded from {ref['llama_server']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
