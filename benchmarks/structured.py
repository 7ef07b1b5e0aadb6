"""`python -m benchmarks structured`: what constraining output to a JSON schema costs a decode tick, beside
llama-server's `json_schema` on the same model.

Through a node (its default, deterministic mode where it holds, and with `--no-deterministic`) and (given
`--llama-server`) llama.cpp's own server with the same model, threads and
8 slots, in rounds whose order rotates: one session decoding alone, unconstrained and constrained, then
eight together with 0, 1 and 8 of them constrained to SCHEMA. Each session runs NEW tokens at
temperature 1 (the schema cannot be complete sooner, so constrained sessions end by LENGTH like the
unconstrained ones, which ignore EOS); ms per decode tick come from the tokens' arrival times
(bench.steady_rate). The cost of constraining at batch 8 is (8 constrained - none) / 8 constrained,
per side. Run it on the bench model (512 tokens) and on bench-32k (32,768 BPE tokens), where a mask over
the vocabulary costs what it does with real models.

The node's mask (llguidance, meshnode/engine/constraint.py) is also timed alone, in this process, over
the model's vocabulary along one constrained answer: the part of a constrained row's cost that is the
constraint library's.
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

from meshnode.bench import llama_build, model_path, steady_rate
from meshnode.core.types import ResponseFormat, Sampling
from meshnode.dev.nodeproc import NodeProcess

NEW = 64
SCHEMA = {"type": "array", "minItems": 20, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999}, "name": {"type": "string", "maxLength": 12},
                   "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}},
                   "ok": {"type": "boolean"}}}}
CASES = (("batch 1, none", 1, 0), ("batch 1, constrained", 1, 1), ("batch 8, none", 8, 0),
         ("batch 8, 1 constrained", 8, 1), ("batch 8, all constrained", 8, 8))


def prompt(i: int) -> list[int]:
    return [3 + (i * 37 + k * 11) % 500 for k in range(16)]


def through_node(path: str, threads: int, *flags: str) -> dict:
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    out = {}
    with NodeProcess(path, "--threads", str(threads), "--log-level", "WARNING", "--max-active", "8", *flags) as node, \
            node.client(timeout_s=900) as c:
        c.generate("warm", tokens=[3, 4, 5], max_tokens=2)
        out["deterministic"] = c.status()["node"]["deterministic"]
        for name, batch, constrained in CASES:
            ids = [f"{name}-{i}" for i in range(batch)]
            for i, sid in enumerate(ids):
                kw = {"response_format": fmt} if i < constrained else {"ignore_eos": True}
                c.submit(sid, tokens=prompt(i), max_tokens=NEW, sampling=Sampling(1.0, 0, 1.0, i), **kw)
            res = c.collect(ids, timeout_s=900)
            assert all(len(r.tokens) == NEW for r in res.values()), {k: r.done for k, r in res.items()}
            for i, sid in enumerate(ids[:constrained]):
                assert res[sid].done.get("incomplete"), res[sid].done  # cut by NEW, as the schema makes sure
            out[name] = steady_rate([r.token_times for r in res.values()])[1]
    return out


def through_llama_server(binary: str, path: str, threads: int) -> dict:
    from meshnode.bench.llama_server import LlamaServer

    out = {}
    with LlamaServer(binary, path, threads, slots=8, ctx=8 * 256) as server:
        for name, batch, constrained in CASES:
            times: list[list[float]] = [[] for _ in range(batch)]
            finals: list[dict] = [{} for _ in range(batch)]

            def one(i: int, constrained: int, times: list, finals: list) -> None:
                params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": i,
                          "ignore_eos": i >= constrained, **({"json_schema": SCHEMA} if i < constrained else {})}
                server.complete(prompt(i), NEW, times[i].append, finals[i], **params)

            workers = [threading.Thread(target=one, args=(i, constrained, times, finals)) for i in range(batch)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            counts = [f.get("tokens_predicted") for f in finals]
            assert counts == [NEW] * batch, counts
            out[name] = steady_rate(times)[1]
    return out


def mask_alone(path: str) -> dict:
    """ms to mask one row (llguidance's bitmask, unpacked, -inf where forbidden) along one constrained
    answer of NEW tokens over the model's own vocabulary, in this process."""
    from meshnode.core.types import Constrained
    from meshnode.engine.constraint import Matchers
    from meshnode.engine.llamacpp import constraint_tokenizer
    from meshnode.text.constraints import Constraints
    from meshnode.text.tokenizer import Tokenizer

    tok = Tokenizer(path)
    try:
        grammar, why = Constraints(tok.vocab, 1 << 30).compile(ResponseFormat("json_schema", json.dumps(SCHEMA)))
        assert grammar, why
        k = Matchers(constraint_tokenizer(tok.vocab), tok.n_vocab).start(Constrained(grammar, 0))
        rng = np.random.default_rng(0)
        ms = []
        for _ in range(NEW):
            logits = rng.standard_normal(tok.n_vocab).astype(np.float32)
            t0 = time.perf_counter()
            masked = k.apply(logits)
            ms.append((time.perf_counter() - t0) * 1e3)
            k.consume(int(rng.choice(np.flatnonzero(np.isfinite(masked)))))
    finally:
        tok.close()
    return {"n_vocab": tok.n_vocab, "mask_ms_median": float(np.median(ms)), "mask_ms_p90": float(np.percentile(ms, 90))}


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    print(f"bench structured: {os.path.basename(path)}, {NEW} tokens per session at temperature 1, {a.rounds} rounds, "
          f"threads {threads}; {llama_build()}", flush=True)
    sides = {"node": lambda: through_node(path, threads),  # the default: deterministic mode where it holds
             "node, not deterministic": lambda: through_node(path, threads, "--no-deterministic")}
    if a.llama_server:
        sides["llama-server"] = lambda: through_llama_server(a.llama_server, path, threads)
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    names = list(sides)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(sides[name]())
            print(f"  round {r + 1} {name:<24}" + "  ".join(f"{case}: {runs[name][-1][case]:.1f}" for case, _, _ in CASES)
                  + " ms/tick", flush=True)
    mask = mask_alone(path)
    summary = _summary(runs, mask)
    for line in summary["verdict"]:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"build": llama_build(), "model": os.path.basename(path), "schema": SCHEMA, "new_tokens": NEW,
                       "runs": runs, "mask": mask, **summary}, f, indent=1)
    return 0


def _summary(runs: dict, mask: dict) -> dict:
    med = {side: {case: float(np.median([r[case] for r in rs])) for case, _, _ in CASES} for side, rs in runs.items()}
    share = {side: (m["batch 8, all constrained"] - m["batch 8, none"]) / m["batch 8, all constrained"]
             for side, m in med.items()}
    modes = (runs["node"][0]["deterministic"], runs["node, not deterministic"][0]["deterministic"])
    verdict = [f"medians of {len(runs['node'])} rounds, ms per decode tick; deterministic mode on the node: {modes[0]}, "
               + f"on the other node: {modes[1]}"]
    for side, m in med.items():
        verdict.append(f"{side}: " + ", ".join(f"{case} {v:.1f}" for case, v in m.items())
                       + f"; constraining all 8 rows costs {share[side]:.1%} of a batch-8 tick")
    verdict.append(f"the mask alone (llguidance, {mask['n_vocab']} tokens): {mask['mask_ms_median']:.3f} ms per row "
                   f"(p90 {mask['mask_ms_p90']:.3f})")
    out = {"median_ms_per_tick": med, "constrained_share_b8": share, "verdict": verdict}
    if "llama-server" in med:
        for side in ("node", "node, not deterministic"):
            ratio = {case: med[side][case] / med["llama-server"][case] for case, _, _ in CASES}
            out[f"{side} / llama-server"] = ratio
            verdict.append(f"{side} / llama-server, ms per tick: " + ", ".join(f"{c} {v:.2f}" for c, v in ratio.items()))
    return out
