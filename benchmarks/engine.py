"""Engine decode throughput at batch 1/2/4/8 vs llama-cpp-python's high-level Llama, one run."""
from __future__ import annotations

import json
import os
import time

import numpy as np

from meshnode.bench import model_path
from meshnode.core.types import Plan, SeqChunk
from meshnode.engine.llama import LlamaEngine
from meshnode.ops.config import engine_config

PROMPT = 8


def decode_rate(engine: LlamaEngine, batch: int, n_tokens: int) -> float:
    """tok/s of `batch` sequences decoding together (prompts prefilled first, not timed)."""
    engine.step(Plan([], list(range(engine.n_seq_max))))
    chunks = [SeqChunk(s, 0, np.arange(3 + s, 3 + s + PROMPT, dtype=np.int32), draw=0) for s in range(batch)]
    last = engine.step(Plan(chunks)).tokens
    t0 = time.perf_counter()
    for i in range(n_tokens):
        plan = Plan([SeqChunk(s, PROMPT + i, np.array([last[s]], np.int32), draw=i + 1) for s in range(batch)])
        last = engine.step(plan).tokens
    return batch * n_tokens / (time.perf_counter() - t0)


def llama_generate_rate(path: str, threads: int, n_tokens: int) -> float:
    """What Python users run today: Llama.generate, greedy, one sequence."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = list(range(3, 3 + PROMPT))
    n, t0 = 0, None
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        if t0 is None:
            t0 = time.perf_counter()  # first token includes prefill: start after it
            continue
        n += 1
        if n == n_tokens:
            break
    rate = n / (time.perf_counter() - t0)
    llm.close()
    return rate


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    engine = LlamaEngine(engine_config(path, n_seq_max=8, ctx=2048, threads=threads, kv_layout="unified",
                                       deterministic=False))
    decode_rate(engine, 1, 4)  # warm-up: page the weights in
    rates = {b: decode_rate(engine, b, a.tokens) for b in (1, 2, 4, 8)}
    engine.close()
    serial = llama_generate_rate(path, threads, a.tokens)
    print(f"model {os.path.basename(path)}  threads {threads}  {a.tokens} decode tokens per sequence")
    print(f"{'':24}{'tok/s':>10}{'vs batch 1':>12}{'vs Llama':>10}")
    print(f"{'Llama.generate serial':24}{serial:10.1f}{serial / rates[1]:12.2f}{1.0:10.2f}")
    for b, r in rates.items():
        print(f"{'engine batch ' + str(b):24}{r:10.1f}{r / rates[1]:12.2f}{r / serial:10.2f}")
    ok = rates[8] >= 3 * rates[1]
    print(f"target batch 8 >= 3x batch 1: {'met' if ok else 'NOT met'} ({rates[8] / rates[1]:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "llama_generate_serial": serial,
                       "engine": {str(b): r for b, r in rates.items()}}, f, indent=2)
    return 0
