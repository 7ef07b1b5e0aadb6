"""Embeddings (issue 53): an embedding session's prompt pooled into one vector, batched by the scheduler beside
generation, through the node protocol and /v1/embeddings; the vectors are llama.cpp's own pooling's."""
import base64

import httpx
import numpy as np
import pytest

from helpers import Pipelined
from helpers import scheduler as build
from ipc import protocol as P
from meshnode.core import reasons as R
from meshnode.core.session import Session
from meshnode.core.types import GREEDY, Plan, SeqChunk
from meshnode.dev.fake import FakeEngine

TOKENS = [3 + (k * 37) % 500 for k in range(150)]


def test_an_embedding_session_ends_with_its_vector_beside_generation():
    e = FakeEngine(cost_ms=lambda plan: 2.0)
    _, s = build(e, max_active=4, max_prefill_tokens_per_tick=32, steps_ms=30.0)
    s.submit(Session("gen", [5, 6, 7], 40))
    s.submit(Session("emb", TOKENS[:90], 1, embed="mean"))
    s.submit(Session("one", [9], 1, embed="last"))
    events = Pipelined(s, e).run_to_completion()
    done = {ev.session.key: ev.reason for ev in events if ev.kind == "done"}
    vectors = {ev.session.key: ev.embedding for ev in events if ev.kind == "embedding"}
    assert done == {"gen": R.LENGTH, "emb": R.EMBEDDED, "one": R.EMBEDDED} and set(vectors) == {"emb", "one"}
    assert all(abs(np.linalg.norm(v) - 1) < 1e-6 for v in vectors.values())
    assert not any(ev.kind == "tokens" and ev.session.key != "gen" for ev in events)
    embed_plans = [p for p in e.plans if any(c.embed for c in p.chunks)]
    assert len(embed_plans) > 2 and all(p.steps == 1 for p in embed_plans)  # 90 tokens in chunks, no multi-step


def test_an_embedding_computes_its_whole_prompt_even_where_the_cache_holds_it():
    """Pooling needs every row's hidden state: an embedding never starts on cached KV (its own KV may be
    cached for others after it)."""
    e = FakeEngine()
    _, s = build(e, max_active=2, prefix_cache="client")
    s.submit(Session("gen", TOKENS[:80], 4, owner="a"))
    Pipelined(s, e).run_to_completion()
    s.submit(Session("emb", TOKENS[:80], 1, owner="a", embed="mean"))
    Pipelined(s, e).run_to_completion()
    first = next(c for p in e.plans for c in p.chunks if c.embed)
    assert first.pos == 0 and not any(p.kv for p in e.plans if any(c.embed for c in p.chunks))


def llama_cpps_own(path: str, tokens: list[int], pooling: int) -> np.ndarray:
    """The vector llama.cpp's own pooling gives (a context made for embeddings, as llama-server's --embedding)."""
    import llama_cpp as lc

    from meshnode.engine import llamacpp

    llamacpp.install_log()
    model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.embeddings, cp.pooling_type = 1024, 512, 512, True, pooling
    cp.n_threads = cp.n_threads_batch = 1
    ctx = lc.llama_init_from_model(model, cp)
    batch = lc.llama_batch_init(len(tokens), 0, 1)
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = t, i, 1, 0, True
    batch.n_tokens = len(tokens)
    assert lc.llama_decode(ctx, batch) == 0
    n = lc.llama_model_n_embd(model)
    v = np.ctypeslib.as_array(lc.llama_get_embeddings_seq(ctx, 0), shape=(n,)).astype(np.float64)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("how, code", [("mean", 1), ("cls", 2), ("last", 3)])
def test_the_engine_pools_as_llama_cpp_does_in_one_call_or_in_chunks(tiny_model, how, code):
    """Beside generation the engine pools the rows itself, chunk by chunk: a prompt cut in chunks gives the
    vector one call gives, and both are llama.cpp's own pooling's (cosine >= 0.9999)."""
    from helpers import engine_config
    from meshnode.engine.llama import LlamaEngine

    want = llama_cpps_own(tiny_model, TOKENS, code)
    got = {}
    with LlamaEngine(engine_config(tiny_model, n_seq_max=4, ctx=4096, threads=1, kv_layout="streams")) as e:
        for cut in (150, 64):
            e.step(Plan([], [0, 1]))
            e.step(Plan([SeqChunk(1, 0, np.array([5, 6, 7], np.int32), draw=0, sampling=GREEDY)]))  # a neighbour
            for p in range(0, 150, cut):
                last = p + cut >= 150
                res = e.step(Plan([SeqChunk(0, p, np.array(TOKENS[p:p + cut], np.int32), draw=0 if last else -1,
                                            sampling=GREEDY if p == 0 else None, embed=how)]))
            got[cut] = np.array(res.embeddings[0])
            assert 0 not in res.tokens
    for v in got.values():
        assert abs(np.linalg.norm(v) - 1) < 1e-5 and float(v @ want) >= 0.9999, float(v @ want)


@pytest.mark.slow
def test_embeddings_through_the_node_protocol_and_the_gateway(tiny_model):
    from ipc.transport import free_tcp_port
    from meshnode.dev.nodeproc import NodeProcess

    port = free_tcp_port()
    with NodeProcess(tiny_model, "--http", f"127.0.0.1:{port}") as n, n.client() as c:
        from test_gateway import gateway_up

        base = f"http://127.0.0.1:{port}"
        gateway_up(base)
        c.send(P.Submit("e1", None, TOKENS, embed=True))
        c.submit("g1", tokens=[5, 6], max_tokens=8)
        got = c.collect(["e1", "g1"])
        ev = next(x for x in got["e1"].events if x["event"] == "embedding") if got["e1"].events else None
        assert got["e1"].done["reason"] == R.EMBEDDED and got["g1"].done["reason"] == R.LENGTH
        assert c.status()["node"]["pooling"] == "mean"
        r = httpx.post(f"{base}/v1/embeddings", json={"input": [TOKENS, "hello there"], "model": "x"}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1] and body["usage"]["prompt_tokens"] > len(TOKENS)
        b64 = httpx.post(f"{base}/embeddings", json={"input": TOKENS, "encoding_format": "base64"}, timeout=60).json()
        bad = httpx.post(f"{base}/v1/embeddings", json={"input": "x", "dimensions": 8}, timeout=60)
    v = np.array(body["data"][0]["embedding"])
    assert ev is not None and np.allclose(v, ev["embedding"], atol=1e-6) and ev["prompt_tokens"] == len(TOKENS)
    assert np.allclose(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4"), v, atol=1e-6)
    assert float(v @ llama_cpps_own(tiny_model, TOKENS, 1)) >= 0.9999
    assert bad.status_code == 400 and "dimensions" in bad.json()["error"]["message"]


def test_an_embed_submit_is_checked_by_the_node():
    for body, words in (({"embed": "max"}, "embed must be"), ({"embed": True, "max_tokens": 4}, "without max_tokens"),
                        ({"embed": True, "messages": [{"role": "user", "content": "x"}], "tokens": None},
                         "with tokens or text")):
        msg = {"op": "submit", "id": "e", "tokens": [3, 4], **body}
        msg = {k: v for k, v in msg.items() if v is not None}
        with pytest.raises(P.ProtocolError, match=words):
            P.decode_request([P.VERSION, __import__("msgpack").packb(msg)], 512)
    sub = P.Submit("e", None, [3, 4], embed="cls")
    assert P.decode_request(P.encode_request(sub), 512) == sub


def test_llama_servers_input_objects_are_their_text_and_anything_else_a_400():
    from meshnode.gateway.api import ApiError
    from meshnode.gateway.embeddings import parse

    ids = iter(range(10))
    submits, _ = parse({"input": ["hello world", {"content": [{"type": "text", "text": "hello "},
                                                              {"type": "text", "text": "world"}]},
                                  {"content": "hi"}]}, lambda: str(next(ids)))
    assert [s.text for s in submits] == ["hello world", "hello world", "hi"]
    for bad in ({"content": 5}, {"content": [{"type": "image_url", "image_url": "x"}]}, {}):
        with pytest.raises(ApiError, match="content must be a string or a list of text parts"):
            parse({"input": [bad]}, lambda: "x")
    with pytest.raises(ApiError, match="input must be"):  # alone, not in a list: as llama-server, refused
        parse({"input": {"content": "hi"}}, lambda: "x")


def test_one_embeddings_request_holds_at_most_a_window_of_the_nodes_queue():
    """The gateway is one client of the node for all its users, so the node's turn-taking cannot keep one
    request's 256 inputs from holding the queue (63 s of it, issue 66): the gateway sends a window at a time,
    and the vectors still come back in the inputs' order."""
    import asyncio

    import json

    from meshnode.gateway.server import EMBED_WINDOW, Gateway

    class Up:
        def __init__(self):
            self.open_now = self.most = 0
            self.sessions = {}

        def open(self, submit):
            self.open_now += 1
            self.most = max(self.most, self.open_now)
            q = asyncio.Queue()
            n = int(submit.text.split()[-1])
            for ev in ({"event": "admitted"}, {"event": "embedding", "embedding": [float(n)], "prompt_tokens": 1},
                       {"event": "done", "reason": R.EMBEDDED}):
                q.put_nowait(ev)
            return q

        def finished(self, sid):
            self.open_now -= 1

        def abandon(self, sid):
            self.open_now -= 1

    class Request:
        async def json(self):
            return {"input": [f"input {i}" for i in range(3 * EMBED_WINDOW + 1)]}

    up = Up()
    resp = asyncio.run(Gateway(up, "m").embeddings(Request()))
    body = json.loads(resp.body)
    assert [d["embedding"][0] for d in body["data"]] == [float(i) for i in range(3 * EMBED_WINDOW + 1)]
    assert up.most == EMBED_WINDOW and up.open_now == 0
