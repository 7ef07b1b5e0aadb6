"""What the sampling options cost: a decode tick at batch 8, greedy vs every option on, one run.

Sampling runs in Python (numpy) on each sampled row after llama_decode, so its cost adds to every
tick. Measured two ways side by side: the engine's whole step at batch 8 (decode + sampling), and
the sampling alone on the same logits rows; rounds alternate greedy and all-options.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from meshnode.bench import llama_build, model_path
from meshnode.core.types import GREEDY, Plan, Sampling, SeqChunk
from meshnode.engine.llama import LlamaEngine
from meshnode.ops.config import engine_config
from meshnode.engine.sampling import logprobs, sample

BATCH, PROMPT = 8, 32
EVERYTHING = Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=1, min_p=0.05, repeat_penalty=1.1,
                      repeat_last_n=64, presence_penalty=0.2, frequency_penalty=0.2, logprobs=5)


def step_ms(engine: LlamaEngine, sampling: Sampling, n: int) -> float:
    """Mean engine step of `n` decode ticks of BATCH sequences with `sampling`."""
    engine.step(Plan([], list(range(BATCH))))
    chunks = [SeqChunk(s, 0, np.arange(3 + s, 3 + s + PROMPT, dtype=np.int32), draw=0, sampling=sampling)
              for s in range(BATCH)]
    last = engine.step(Plan(chunks)).tokens
    total = 0.0
    for i in range(n):
        res = engine.step(Plan([SeqChunk(s, PROMPT + i, np.array([last[s]], np.int32), draw=i + 1)
                                for s in range(BATCH)]))
        last, total = res.tokens, total + res.step_ms
    return total / n


def sampling_ms(logits: np.ndarray, sampling: Sampling, history: list[int], n: int) -> float:
    """Mean time to sample BATCH rows (and their logprobs when asked), the decode left out."""
    t0 = time.perf_counter()
    for i in range(n):
        for row in logits:
            tok = sample(row, sampling, i, history)
            if sampling.logprobs:
                logprobs(row, tok, sampling.logprobs)
    return (time.perf_counter() - t0) * 1e3 / n


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    n = a.tokens
    with LlamaEngine(engine_config(path, n_seq_max=BATCH, ctx=BATCH * 256, threads=threads, kv_layout="unified",
                                          deterministic=False)) as engine:
        step_ms(engine, GREEDY, 4)  # warm-up: page the weights in
        rows = {"greedy": [], "everything": []}
        for _ in range(a.rounds):
            rows["greedy"].append(step_ms(engine, GREEDY, n))
            rows["everything"].append(step_ms(engine, EVERYTHING, n))
        p = np.array([3 + k % 100 for k in range(PROMPT)], np.int32)
        logits = np.stack([engine.logits_for(Plan([SeqChunk(0, 0, p, draw=0)], [0]))[0]] * BATCH)
    history = list(range(3, 3 + PROMPT))
    alone = {"greedy": sampling_ms(logits, GREEDY, history, n), "everything": sampling_ms(logits, EVERYTHING, history, n)}
    med = {k: float(np.median(v)) for k, v in rows.items()}
    extra = med["everything"] - med["greedy"]
    print(f"model {os.path.basename(path)} (vocab {logits.shape[1]}), batch {BATCH}, threads {threads}, "
          f"{a.rounds} rounds x {n} ticks, {llama_build()}")
    print(f"engine step, greedy:      {med['greedy']:7.2f} ms  (rounds {', '.join(f'{x:.2f}' for x in rows['greedy'])})")
    print(f"engine step, all options: {med['everything']:7.2f} ms  (rounds {', '.join(f'{x:.2f}' for x in rows['everything'])})")
    print(f"sampling alone per tick:  greedy {alone['greedy']:.2f} ms, all options + logprobs 5 {alone['everything']:.2f} ms")
    print(f"all options cost {extra:+.2f} ms per tick = {extra / med['greedy']:+.1%} of a greedy decode tick")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "batch": BATCH, "ticks": n,
                       "step_ms": rows, "step_ms_median": med, "sampling_alone_ms": alone,
                       "extra_ms": extra, "extra_ratio": extra / med["greedy"]}, f, indent=2)
    return 0
