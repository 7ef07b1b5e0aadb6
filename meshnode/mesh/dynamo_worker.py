"""`meshnode dynamo-worker`: a node as an NVIDIA Dynamo worker, so that Dynamo's KV router spreads a mesh's
traffic over nodes by the prefixes they hold (issue 68; Dynamo 1.6.1, the `dynamo` extra).

The worker is a client of its node, as the HTTP gateway is (its connection is the gateway's Upstream): it
serves a Dynamo endpoint of token-in/token-out requests (the frontend's or a KvRouter's preprocessed request:
`token_ids`, `sampling_options`, `stop_conditions`), each one session of the node, and streams the node's
tokens back as Dynamo's chunks (`token_ids`, the last with `finish_reason` and `completion_usage`). A request
Dynamo stops is cancelled at the node; a refusal or a session the node could not finish raises, which ends
the stream as an error that Dynamo's `--migration-limit` retries on another worker. The node's KV events
(its `--kv-events` socket) are relayed by Dynamo's own KvEventPublisher, so the router's prefix tree is the
node's cache. The model is registered with what the node says of itself (context per session, sessions at
once, KV blocks) and, with `--hf-folder DIR`, the Hugging Face tokenizer folder Dynamo's OpenAI frontend
tokenizes with (written there from the node's GGUF when DIR has none: mesh/hf_folder.py); without it, with no
model assets, which a KvRouter takes and the frontend does not.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets

from ipc import protocol as P
from meshnode.core.kvevents import BLOCK_TOKENS
from meshnode.core import reasons as R
from meshnode.core.types import Sampling
from meshnode.gateway.upstream import NODE_GONE, Upstream

log = logging.getLogger("meshnode.mesh")
FINISH = {R.EOS: "stop", R.STOP: "stop", R.LENGTH: "length"}  # the node's reasons -> Dynamo's finish reasons
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "repetition_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}  # Dynamo's sampling_options -> the node's Sampling


# what the node says when it cannot serve the request now but another node could: Dynamo migrates such a request
# (its frontend's --migration-limit takes an EngineShutdown as a worker gone)
ELSEWHERE = {R.ENGINE_ERROR, R.DRAINED, R.REJECTED_DRAINING, R.REJECTED_ENGINE_UNAVAILABLE, NODE_GONE}


class WorkerError(RuntimeError):
    """A request the node refused or did not finish, with the node's reason (or the connection's code): the
    stream ends with it."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why

    @property
    def elsewhere(self) -> bool:
        """Another node could serve it (this one is gone, draining or without its engine): Dynamo migrates it."""
        return self.why in ELSEWHERE

    @staticmethod
    def of(ev: dict, what: str) -> WorkerError:
        why = ev.get("reason") or ev.get("code") or ""
        return WorkerError(f"{what}: {why}: {ev.get('detail', '')}".rstrip(": "), why)


def submit_of(request: dict, sid: str) -> P.Submit:
    """Dynamo's preprocessed request -> the node's submit (the node checks every value, as any client's)."""
    opts = {SAMPLING[k]: v for k, v in (request.get("sampling_options") or {}).items()
            if k in SAMPLING and v is not None}
    if opts.get("top_k", 0) < 0:  # Dynamo's and vLLM's "off"
        opts.pop("top_k")
    stop = request.get("stop_conditions") or {}
    stop_ids = [*(stop.get("stop_token_ids_hidden") or ()), *(stop.get("stop_token_ids") or ())]
    return P.Submit(sid, stop.get("max_tokens"), tokens=list(request["token_ids"]), sampling=Sampling(**opts),
                    stop_tokens=stop_ids, ignore_eos=bool(stop.get("ignore_eos")),
                    stop=list(stop.get("stop") or ()))


def chunk_of(ev: dict, prompt_tokens: int) -> dict:
    """A node event (tokens or done) -> Dynamo's output chunk; WorkerError for a session that did not finish."""
    if ev["event"] == "tokens":
        return {"index": 0, "token_ids": list(ev["tokens"])}
    if ev["event"] != "done" or ev["reason"] not in FINISH:
        raise WorkerError.of(ev, "the node ended the request")
    u = ev["usage"]
    return {"index": 0, "token_ids": [], "finish_reason": FINISH[ev["reason"]],
            "completion_usage": {"prompt_tokens": prompt_tokens, "completion_tokens": u["completion_tokens"],
                                 "total_tokens": prompt_tokens + u["completion_tokens"],
                                 "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)}}}


class Worker:
    """The endpoint's handler: each Dynamo request a session of the node. `migratable(message)`: the exception
    that makes Dynamo send the request to another worker; `gone()`: called when the node cannot be reached (the
    worker then leaves, so the router stops choosing it)."""

    def __init__(self, up, migratable=WorkerError, gone=lambda: None):
        self.up, self.migratable, self.gone = up, migratable, gone

    async def generate(self, request: dict, context=None):
        try:
            async for chunk in self._generate(request):
                yield chunk
        except WorkerError as e:
            if not e.elsewhere:
                raise
            if e.why == NODE_GONE:
                self.gone()
            raise self.migratable(str(e)) from None

    async def _generate(self, request: dict):
        sub = submit_of(request, secrets.token_hex(12))
        try:
            q = self.up.open(sub)
        except (OverflowError, ValueError) as e:
            raise WorkerError(str(e)) from None
        done = False
        try:
            first = await q.get()
            if first["event"] != "admitted":
                done = True
                raise WorkerError.of(first, "the node refused the request")
            while True:
                ev = await q.get()
                done = ev["event"] != "tokens"
                yield chunk_of(ev, len(sub.tokens))
                if done:
                    return
        finally:
            if done:
                self.up.finished(sub.id)
            else:  # Dynamo stopped the stream (a cancelled request), or it failed here: cancel at the node
                self.up.abandon(sub.id)


async def serve(a) -> int:
    from dynamo._core import DistributedRuntime
    from dynamo.llm import KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.llm.exceptions import EngineShutdown

    from ipc.transport import client_curve

    up = Upstream(a.node, **client_curve(a.curve_server_key, a.curve_client_cert))
    await up.start()
    node = (await up.ask(P.Status(), timeout_s=30.0))["node"]
    budgets = node["budgets"]
    rt = DistributedRuntime(asyncio.get_running_loop(), a.discovery_backend, "tcp", event_plane="zmq")
    ep = rt.endpoint(f"{a.namespace}.{a.component}.generate")
    leave = asyncio.Event()
    worker = Worker(up, EngineShutdown, leave.set)
    serving = asyncio.ensure_future(ep.serve_endpoint(worker.generate))
    rc = ModelRuntimeConfig()
    rc.context_length, rc.max_num_seqs = budgets["n_ctx_seq"], budgets["max_active"]
    rc.total_kv_blocks = budgets["kv_budget_bytes"] // node["kv_bytes_per_token"] // BLOCK_TOKENS
    name = a.model_name or node["model"].rsplit("/", 1)[-1]
    if a.hf_folder and not os.path.exists(os.path.join(a.hf_folder, "tokenizer.json")):
        from meshnode.mesh.hf_folder import write

        write(node["model"], a.hf_folder)  # from the node's GGUF, where this host reads it (ValueError: which not)
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, ep, a.hf_folder or name, name,
                         worker_type=WorkerType.Aggregated, kv_cache_block_size=BLOCK_TOKENS, runtime_config=rc,
                         skip_model_assets=not a.hf_folder)
    relay = KvEventPublisher(ep, kv_block_size=BLOCK_TOKENS, zmq_endpoint=a.kv_events) if a.kv_events else None
    log.info("meshnode dynamo-worker ready: node=%s endpoint=%s.%s.generate model=%s kv_events=%s", a.node,
             a.namespace, a.component, name, a.kv_events or "off (the router cannot see the node's cache)")
    try:
        await asyncio.wait([serving, asyncio.ensure_future(leave.wait())], return_when=asyncio.FIRST_COMPLETED)
        if leave.is_set():
            log.error("the node at %s cannot be reached: leaving Dynamo, so that its router stops choosing this "
                      "worker (its requests are migrated)", a.node)
            for _ in range(100):  # the requests open on it fail first (migratable), before the runtime cancels them
                if not up.sessions:
                    break
                await asyncio.sleep(0.05)
    finally:
        if relay is not None:
            relay.shutdown()
        await up.close()
        rt.shutdown()
    return 1 if leave.is_set() else 0


def main(a) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import dynamo.llm  # noqa: F401
    except ImportError:
        print("meshnode dynamo-worker: NVIDIA Dynamo's runtime is not installed: pip install 'meshnode[dynamo]'",
              file=__import__("sys").stderr)
        return 2
    return asyncio.run(serve(a))
