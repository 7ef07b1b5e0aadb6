"""The node vs what Python users run today: llama-cpp-python's Llama, one request at a time.

The same 16 jobs (prompts 4 to 100 tokens, 32 new tokens) go through a node at
concurrency 8 and through `Llama.generate` serially, greedy, in one run.
"""
from __future__ import annotations

import json
import os
import time

from meshnode.bench import model_path
from meshnode.bench.overhead import jobs, through_node


def llama_serial(path: str, threads: int, work) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.generate([3, 4, 5], temp=0.0).__next__()  # page the weights in, as the node's warm-up does
    out, t0 = {}, time.perf_counter()
    for sid, toks, n in work:
        got = []
        for tok in llm.generate(toks, temp=0.0, top_k=1, reset=True):
            got.append(tok)
            if len(got) == n:
                break
        out[sid] = got
    wall = time.perf_counter() - t0
    llm.close()
    return {"wall_s": wall, "tokens": out, "gen_tok_s": sum(map(len, out.values())) / wall}


def main(a) -> int:
    path = model_path(a)
    threads = a.threads or os.cpu_count()
    work = jobs(a.tokens)
    serial = llama_serial(path, threads, work)
    node = through_node(path, threads, work)
    ratio = node["gen_tok_s"] / serial["gen_tok_s"]
    same = sum(serial["tokens"][k] == node["tokens"][k] for k in serial["tokens"])
    print(f"model {os.path.basename(path)}  16 jobs, prompts 4-100, {a.tokens} new tokens, threads {threads}")
    print(f"{'':34}{'gen tok/s':>10}{'wall s':>8}")
    print(f"{'Llama.generate, one at a time':34}{serial['gen_tok_s']:10.1f}{serial['wall_s']:8.2f}")
    print(f"{'meshnode node, concurrency 8':34}{node['gen_tok_s']:10.1f}{node['wall_s']:8.2f}")
    print(f"node / serialized: {ratio:.2f}x  (target >= 2.0x: {'met' if ratio >= 2.0 else 'NOT met'})")
    print(f"jobs with identical greedy tokens: {same}/{len(work)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "serial_tok_s": serial["gen_tok_s"],
                       "node_tok_s": node["gen_tok_s"], "ratio": ratio, "identical_jobs": same,
                       "jobs": len(work)}, f, indent=2)
    return 0
