"""The node's KV events as NVIDIA Dynamo's own router reads them (issue 68): Dynamo's KvEventPublisher relays the
node's --kv-events socket (its ZMQ decoder, vLLM's KVEventBatch), its KvRouter keeps the prefix tree, and the
router's overlap credit for a prompt must be the blocks the node holds for it. Skipped where the `dynamo` extra
is not installed (`pip install -e '.[dynamo]'`; the README's dev set-up installs it)."""
import asyncio
import os
import subprocess
import sys

import pytest

from helpers import prompt
from ipc.transport import free_tcp_port
from meshnode.core.kvevents import BLOCK_TOKENS
from meshnode.dev.nodeproc import NodeProcess

dynamo_llm = pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed")
LOOPBACK = {k: "127.0.0.1" for k in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST",
                                     "DYN_SYSTEM_HOST")}


async def _device_blocks(router, tokens: list[int], want: int, tries: int = 200) -> int:
    """The router's device-tier credit for `tokens` once it reaches `want` (events arrive asynchronously)."""
    got = -1
    for _ in range(tries):
        workers = (await router.get_overlap_scores(tokens))["workers"]
        got = workers[0]["device_blocks"] if workers else -1
        if got == want:
            return got
        await asyncio.sleep(0.05)
    return got


def test_dynamos_router_credits_exactly_the_blocks_the_node_holds(tiny_model, tmp_path, monkeypatch):
    from dynamo._core import DistributedRuntime

    for k, v in {**LOOPBACK, "DYN_FILE_KV": str(tmp_path / "discovery")}.items():
        monkeypatch.setenv(k, v)
    events = f"tcp://127.0.0.1:{free_tcp_port()}"
    a = prompt(5 * BLOCK_TOKENS + 3)  # 83 tokens; held with its first generated one: 84, five whole blocks
    b = a[:3 * BLOCK_TOKENS] + prompt(2 * BLOCK_TOKENS + 8, salt=9)  # shares a's first three blocks
    unseen = prompt(4 * BLOCK_TOKENS, salt=5)

    async def run(node):
        rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
        ep = rt.endpoint("mesh.node.generate")

        async def handler(request, context=None):  # never called: the router is only asked for overlaps here
            yield {"token_ids": [], "finish_reason": "stop"}

        serving = asyncio.ensure_future(ep.serve_endpoint(handler))
        await dynamo_llm.register_model(dynamo_llm.ModelInput.Tokens, dynamo_llm.ModelType.Chat, ep, "meshnode",
                                        "tiny", worker_type=dynamo_llm.WorkerType.Aggregated,
                                        kv_cache_block_size=BLOCK_TOKENS, skip_model_assets=True)
        relay = dynamo_llm.KvEventPublisher(ep, kv_block_size=BLOCK_TOKENS, zmq_endpoint=events)  # alive while used
        router = dynamo_llm.KvRouter(ep, BLOCK_TOKENS, dynamo_llm.KvRouterConfig())
        got = {}
        with node.client() as c:
            for k in range(50):  # until the relay and the router listen (ZeroMQ's late joiners miss what came before)
                warm = prompt(BLOCK_TOKENS + 4, salt=100 + k)
                assert (await asyncio.to_thread(c.generate, f"w{k}", tokens=warm, max_tokens=2, ignore_eos=True)).done
                if await _device_blocks(router, warm, 1, tries=20) == 1:
                    break
            for name, p in (("a", a), ("b", b)):
                assert (await asyncio.to_thread(c.generate, name, tokens=p, max_tokens=2, ignore_eos=True)).done
                held = (len(p) + 1) // BLOCK_TOKENS  # the prompt and its first generated token
                got[name] = (await _device_blocks(router, p, held), held)
        got["a again"] = (await _device_blocks(router, a, 5), 5)
        got["a's first three, then others"] = (await _device_blocks(router, a[:48] + unseen, 3), 3)
        got["unseen"] = (await _device_blocks(router, unseen, 0), 0)
        relay.shutdown()
        serving.cancel()
        rt.shutdown()
        return got

    with NodeProcess(tiny_model, "--kv-events", events) as node:
        got = asyncio.run(run(node))
    assert all(g == want for g, want in got.values()), got


async def _collect(stream) -> tuple[list[int], dict]:
    toks, last = [], {}
    async for chunk in stream:
        chunk = chunk.data() if hasattr(chunk, "data") else chunk
        toks, last = toks + list(chunk.get("token_ids") or ()), chunk
    return toks, last


def test_two_nodes_as_dynamo_workers_behind_its_kv_router(tiny_model, tmp_path, monkeypatch):
    """`meshnode dynamo-worker` for each of two nodes; Dynamo's KvRouter (no frontend: the workers register no
    tokenizer folder) sends a conversation's turns: the greedy tokens are the node's own answer, and the next
    turn goes to the node holding its prefix, which reuses it."""
    from dynamo._core import DistributedRuntime

    env = {**LOOPBACK, "DYN_FILE_KV": str(tmp_path / "discovery")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    events = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    ask = {"stop_conditions": {"max_tokens": 4, "ignore_eos": True}, "sampling_options": {"temperature": 0}}
    turn1 = prompt(5 * BLOCK_TOKENS + 3, salt=3)

    async def run(nodes) -> dict:
        workers = [subprocess.Popen([sys.executable, "-m", "meshnode", "dynamo-worker", "--node", n.listen,
                                     "--kv-events", e, "--model-name", "tiny"], env={**os.environ, **env},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for n, e in zip(nodes, events)]
        rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
        try:
            router = dynamo_llm.KvRouter(rt.endpoint("mesh.meshnode.generate"), BLOCK_TOKENS,
                                         dynamo_llm.KvRouterConfig())
            for _ in range(600):  # both workers registered (a worker's start imports Dynamo: seconds)
                if len((await router.get_overlap_scores(turn1))["workers"]) == 2:
                    break
                await asyncio.sleep(0.1)
            out = {"workers": len((await router.get_overlap_scores(turn1))["workers"])}
            out["turn1"], end1 = await _collect(await router.generate(turn1, "tiny", **ask))
            out["finish"], out["usage"] = end1.get("finish_reason"), end1.get("completion_usage")
            held = [w for w in (await router.get_overlap_scores(turn1))["workers"] if w["device_blocks"]]
            for _ in range(100):  # the serving node's events reach the router
                if held:
                    break
                await asyncio.sleep(0.05)
                held = [w for w in (await router.get_overlap_scores(turn1))["workers"] if w["device_blocks"]]
            turn2 = turn1 + out["turn1"] + prompt(20, salt=4)
            out["held"] = [(w["worker_id"], w["device_blocks"]) for w in held]
            out["best"] = await router.best_worker(turn2)
            _, end2 = await _collect(await router.generate(turn2, "tiny", **ask))
            out["turn2_cached"] = end2["completion_usage"]["prompt_tokens_details"]["cached_tokens"]
            return out
        finally:
            for w in workers:
                w.terminate()
                w.wait(timeout=30)
            rt.shutdown()

    with NodeProcess(tiny_model, "--kv-events", events[0]) as a, NodeProcess(tiny_model, "--kv-events", events[1]) as b:
        got = asyncio.run(run([a, b]))
        with b.client() as c:  # the same greedy answer from a node directly
            own = c.generate("own", tokens=turn1, max_tokens=4, ignore_eos=True).done["tokens"]
    assert got["workers"] == 2 and got["turn1"] == own and got["finish"] == "length", got
    assert got["usage"]["prompt_tokens"] == len(turn1) and got["usage"]["completion_tokens"] == 4
    (holder, blocks), = got["held"]  # one node holds turn 1: the one that answered it
    assert blocks == 5 and got["best"][0] == holder and got["best"][2] >= 5, got
    assert got["turn2_cached"] >= 5 * BLOCK_TOKENS, got  # routed there, it reused turn 1's KV
