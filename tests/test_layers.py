"""The package layout is the architecture: this test fails when a layer imports what it must not.

Pure policy (meshnode.core) imports nothing of the node and no I/O; engines run one model in-process
with no I/O; the wire (ipc) knows the shared types and nothing above them; the two process shells sit
on top. Every import is checked, function-level ones included.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# what each layer may import from the project (prefixes); anything else of the project is a violation
ALLOWED = {
    "meshnode.core": ["meshnode.core"],
    "meshnode.engine": ["meshnode.core", "meshnode.engine"],
    "meshnode.text": ["meshnode.core", "meshnode.engine.llamacpp", "meshnode.text"],
    "ipc": ["meshnode.core", "ipc"],
    # production never imports test helpers (meshnode.dev: a test's engine is built by the factory it names,
    # imported by name), and the front spawns the worker by module path
    "meshnode.worker": ["meshnode.core", "meshnode.engine", "ipc", "meshnode.ops.memory", "meshnode.worker"],
    "meshnode.front": ["meshnode.core", "meshnode.text", "ipc", "meshnode.ops", "meshnode.front",
                       "meshnode.__version__", "meshnode.engine.llamacpp"],
    "meshnode.ops": ["meshnode.core", "meshnode.engine", "ipc", "meshnode.ops"],
    "meshnode.client": ["meshnode.core", "ipc"],
    # the HTTP gateway is a client of the front: the wire and the tokenizer (token names), never the node's insides
    "meshnode.gateway": ["meshnode.core", "ipc", "meshnode.text", "meshnode.gateway"],
    # workers under distributed engines are clients of a node too, over the gateway's connection to it
    "meshnode.mesh": ["meshnode.core", "ipc", "meshnode.gateway.upstream", "meshnode.mesh"],
    # the top shell: every command, each importing what it runs (test_the_parser_loads_no_tool_module below)
    "meshnode.cli": ["meshnode", "ipc"],
    # helpers for tests, drills and benchmarks: node processes, fake and reference engines, in-process driving
    "meshnode.dev": ["meshnode.core", "meshnode.engine", "ipc", "meshnode.ops", "meshnode.client", "meshnode.dev",
                     "meshnode.front.command"],
    # the harnesses `meshnode bench` runs: nodes through the client, engines in-process, llama-server beside
    "meshnode.bench": ["meshnode.core", "meshnode.engine", "ipc", "meshnode.ops", "meshnode.client", "meshnode.text",
                       "meshnode.dev", "meshnode.bench"],
    # the experiments behind evidence/: anything of the project, nothing of it imports them
    "benchmarks": ["meshnode", "ipc", "benchmarks"],
}
# third-party and stdlib modules a layer must not touch: policy has no sockets, threads or llama.cpp
BANNED = {
    "meshnode.core": {"zmq", "llama_cpp", "threading", "socket", "select", "msgpack", "psutil", "multiprocessing",
                      "subprocess", "signal", "ctypes", "gguf", "queue"},
    "meshnode.engine": {"zmq", "socket", "select", "msgpack", "threading", "multiprocessing", "psutil", "queue",
                        "subprocess"},
    "ipc": {"llama_cpp", "gguf"},
}


def layer_of(module: str) -> str | None:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def modules():
    for path in sorted(p for top in ("meshnode", "ipc", "benchmarks") for p in (ROOT / top).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        yield name, path


def absolute(node: ast.ImportFrom, path: pathlib.Path) -> str:
    """The module a `from` import names, relative ones (`from . import x`, `from ..core import y`) resolved."""
    if not node.level:
        return node.module
    package = path.relative_to(ROOT).parent.parts
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ((node.module,) if node.module else ()))


def imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node, path)
            pkg = ROOT.joinpath(*module.split("."))
            if pkg.is_dir():  # `from meshnode.engine import llamacpp` imports meshnode.engine.llamacpp
                yield from (f"{module}.{a.name}" for a in node.names)
            else:
                yield module


def test_relative_imports_are_resolved_and_checked():
    """`from ..front import node` inside meshnode/core would be a violation like its absolute spelling."""
    core = ROOT / "meshnode" / "core" / "scheduler.py"
    tree = ast.parse("from ..front import node\nfrom . import reasons\nfrom .types import Plan\n")
    got = [absolute(n, core) for n in tree.body]
    assert got == ["meshnode.front", "meshnode.core", "meshnode.core.types"]


CASES = [(name, path) for name, path in modules() if layer_of(name)]


@pytest.mark.parametrize("name, path", CASES, ids=[c[0] for c in CASES])
def test_each_module_imports_only_what_its_layer_may(name, path):
    layer = layer_of(name)
    bad = []
    for mod in imports(path):
        top = mod.split(".")[0]
        if top in BANNED.get(layer, ()):
            bad.append(f"{mod} (no {top} in {layer})")
        ours = top in ("meshnode", "ipc", "benchmarks")
        if ours and not any(mod == ok or mod.startswith(ok + ".") for ok in ALLOWED[layer]):
            bad.append(mod)
    assert not bad, f"{name} ({layer}) imports {bad}"


def test_no_layer_imports_another_in_a_circle():
    """Between layers, the imports form no cycle (a layer importing itself is fine)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules():
        src = layer_of(name) or name
        for mod in imports(path):
            dst = layer_of(mod)
            if dst and dst != src:
                edges.setdefault(src, set()).add(dst)
    seen, stack = set(), []

    def visit(n):
        if n in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(n):] + [n])}")
        if n in seen:
            return
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            visit(m)
        stack.pop()
        seen.add(n)

    for n in sorted(edges):
        visit(n)


def test_the_parser_loads_no_tool_module():
    """`meshnode serve` builds the whole parser before it serves: that must not load the test helpers
    (meshnode.dev) or the experiments, which only the commands that run them import."""
    import subprocess
    import sys

    code = ("import sys; from meshnode.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith(('meshnode.dev', 'benchmarks'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout
