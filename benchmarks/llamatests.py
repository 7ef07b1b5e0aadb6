"""`python -m benchmarks llamatests --llama-server PATH [--model smollm2-q8_0] [--kinds FILES]`: llama.cpp's own
server tests (tools/server/tests in the llama.cpp source the llama-server binary was built from) run against
llama-server and against `meshnode serve --http` on the same local model, and the pass table of both.

The suite is copied to a scratch folder and run by pytest against llama-server, then against meshnode
on the tests of the OpenAI surface llama-server passed, with benchmarks/llamatests_plugin.py: every
preset's Hugging Face model becomes `--model` (nothing is downloaded), and each test's outcome and the paths
it asked for are recorded. For meshnode, LLAMA_SERVER_BIN_PATH is benchmarks/llamashim.py, which maps
llama-server's flags to the node's. A test is of the OpenAI surface where every request it makes by path
goes to an OpenAI path (those through the `openai` package always do); the others use llama-server's own
endpoints (/completion, /tokenize, /slots, /props, ...), which the node does not serve. The goal (issue 53):
meshnode passes every OpenAI-surface test llama-server passes on the model; the table lists the rest with
the line that failed.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from meshnode.bench import llama_build, model_path

FILES = ("test_basic.py", "test_chat_completion.py", "test_completion.py", "test_compat_oai_responses.py",
         "test_embedding.py", "test_ignore_eos.py", "test_metrics.py", "test_security.py", "test_stream.py",
         "test_tool_call.py")
# llama-server's OpenAI paths (server.cpp): its /completions and /embeddings without /v1 are its own formats
OPENAI = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/v1/responses", "/responses",
          "/v1/embeddings", "/v1/models", "/models", "/health", "/v1/health", "/metrics")
HERE = os.path.dirname(os.path.abspath(__file__))


def suite_dir(server: str) -> str:
    """The tests beside the source llama-server was built from (the notes' recipe: $SRC/build/bin and
    $SRC/llama_cpp_python-*/vendor/llama.cpp), or LLAMA_SERVER_TESTS."""
    if os.environ.get("LLAMA_SERVER_TESTS"):
        return os.environ["LLAMA_SERVER_TESTS"]
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(server))))
    found = glob.glob(os.path.join(src, "*", "vendor", "llama.cpp", "tools", "server", "tests"))
    found += glob.glob(os.path.join(src, "tools", "server", "tests"))
    if not found:
        raise SystemExit(f"llamatests: no tools/server/tests near {server}; set LLAMA_SERVER_TESTS")
    return found[0]


def run_side(suite: str, tests: list[str], model: str, binary: str, out: str) -> float:
    work = tempfile.mkdtemp(prefix="llamatests-")
    shutil.copytree(suite, work, dirs_exist_ok=True)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": binary, "LLAMATESTS_MODEL": model, "LLAMATESTS_OUT": out,
           "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "llamatests_plugin", "-p", "no:cacheprovider",
                    "-o", "addopts=", *tests], cwd=work, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=5400)
    shutil.rmtree(work, ignore_errors=True)
    return time.perf_counter() - t0


def openai_only(paths: list[str]) -> bool:
    return all(p.split()[1].split("?")[0] in OPENAI for p in paths)


def main(a) -> int:
    if not a.llama_server:
        raise SystemExit("llamatests: --llama-server PATH (the binary whose source holds the tests)")
    model = model_path(a)
    suite = suite_dir(a.llama_server)
    files = a.kinds.split(",") if a.kinds else list(FILES)
    shim = os.path.join(tempfile.mkdtemp(prefix="llamashim-bin-"), "llama-server")
    with open(shim, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} {os.path.join(HERE, 'llamashim.py')} \"$@\"\n")
    os.chmod(shim, 0o755)
    print(f"bench llamatests: {suite}, {len(files)} files, model {os.path.basename(model)}; {llama_build()}")
    got, took = {}, {}
    tests = [os.path.join("unit", f) for f in files]
    for side, binary in (("llama-server", a.llama_server), ("meshnode", shim)):
        out = os.path.join(tempfile.mkdtemp(), "results.json")
        took[side] = run_side(suite, tests, model, binary, out)
        with open(out) as f:
            got[side] = {k: v for k, v in json.load(f).items() if "outcome" in v}
        n = len(got[side])
        print(f"  {side}: {sum(v['outcome'] == 'passed' for v in got[side].values())} of {n} passed, {took[side]:.0f} s")
        # the node runs what llama-server passed of the OpenAI surface
        tests = sorted(t for t, v in got[side].items() if v["outcome"] == "passed" and openai_only(v["paths"]))
    ref, ours = got["llama-server"], got["meshnode"]
    surface = {t for t, v in ref.items() if openai_only(v["paths"] + ours.get(t, {}).get("paths", []))}
    base = sorted(t for t in surface if ref[t]["outcome"] == "passed")
    passed = [t for t in base if ours.get(t, {}).get("outcome") == "passed"]
    print(f"OpenAI surface (tests calling none of llama.cpp's own endpoints, run or not): {len(surface)}; "
          f"llama-server passes {len(base)}, meshnode {len(passed)} of those")
    for t in base:
        if t not in passed:
            print(f"  meshnode fails {t}: {ours.get(t, {}).get('why', 'not run')}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"suite": suite, "model": model, "build": llama_build(), "files": files, "seconds": took,
                       "surface": sorted(surface), "llama_server_passes": base, "meshnode_passes": passed,
                       "results": got}, f, indent=1)
    return 0
