import os

import pytest

# Nodes the tests start run llama.cpp on ONE thread (tests/test_node.py's module node keeps the default, all
# cores, with `--threads 0`): llama.cpp's threads spin at every barrier, so with the test, the front and
# the engine sharing two cores, and more so beside other load, a second engine thread mostly waits for a
# preempted first one (on this 2-core machine test_clients.py took 165 s with two busy loops beside it at
# the default, 71 s at one thread). The tiny models' numerics do not depend on the thread count.
os.environ.setdefault("MESHNODE_THREADS", "1")

# property tests search the same examples every run: a test that passes once passes again, and a failure is
# one a rerun shows again (hypothesis' default draws anew each run)
from hypothesis import settings  # noqa: E402

settings.register_profile("meshnode", derandomize=True, database=None)
settings.load_profile("meshnode")


def _unterminated_context(self) -> None:
    """pyzmq's Context.__del__ terminates a garbage context, which blocks for ever when its sockets are in
    the same garbage: the collector clears the context's weak references to them first, so it cannot close
    them (a quiet suite run hung in Context.term, reached from the collector, twice in two stops). In the
    tests' process a lost context is reported as a ResourceWarning instead, and the run goes on; Client
    closes itself through a finalizer (meshnode/client.py), and the tests' raw sockets use `zctx`."""
    if not getattr(self, "closed", True):
        import warnings

        warnings.warn(f"zmq context {self!r} garbage-collected unterminated (a leaked socket or client)",
                      ResourceWarning, stacklevel=1)


import zmq  # noqa: E402

zmq.Context.__del__ = _unterminated_context


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny demo GGUF (10 MB, f32), written once per test run; never downloaded."""
    from meshnode.ops.models import make_model

    return str(make_model(tmp_path_factory.mktemp("models") / "tiny.gguf", "tiny", 0))


def pytest_collection_modifyitems(items):
    """Every test that needs the model (directly or through a fixture) loads llama.cpp or starts a node:
    slow. The few that start processes without it carry the marker themselves."""
    for item in items:
        if "tiny_model" in item.fixturenames:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def zctx():
    """A zmq context for the test's raw sockets, destroyed at teardown whatever happened: a test that fails
    before it closes them leaves the context and its sockets in a cycle with the traceback, and the
    garbage collector's later pyzmq finalizer terminates a context whose sockets it can no longer see,
    blocking for ever at some later test (a whole hogged run hung so, once)."""
    import zmq

    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """A node with its gateway child, an openai client on it, and the node's own ZeroMQ client: one for each
    gateway test module (tests/test_gateway*.py)."""
    import openai

    from gateway_node import gateway_up
    from ipc.transport import free_tcp_port
    from meshnode.dev.nodeproc import NodeProcess

    port, metrics = free_tcp_port(), free_tcp_port()
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# one per line\nsk-test-1\n")
    with NodeProcess(tiny_model, "--http", f"127.0.0.1:{port}", "--http-api-key-file", str(keys),
                     "--metrics-listen", f"127.0.0.1:{metrics}", "--max-active", "2", "--max-queue", "0",
                     "--served-model-name", "tiny-chat") as n, \
            n.client() as c:
        base = f"http://127.0.0.1:{port}"
        gateway_up(base)
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test-1", max_retries=0, timeout=120)
        yield base, oa, c, n
        oa.close()
