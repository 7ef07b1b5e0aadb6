"""Deterministic mode on the stock llama.cpp build: the batch shapes that keep a sequence's numbers its own.

llama.cpp's CPU kernels give a row the same bits whatever else is in its call, with
two exceptions this module works around (docs/determinism.md has the source lines):
- a matmul of ONE column leaves llamafile's tinyBLAS for `ggml_vec_dot`, which sums
  in another order; every 2 or more columns give the same bits. On per-sequence
  streams llama.cpp runs one ubatch per run of consecutive streams, so a run holding
  one row gets a dummy row on an adjacent stream (`pads`), removed after the call;
  and a ubatch asks for logits on 0 or >= 2 rows (the last layer's FFN and the output
  projection run only on those);
- flash attention runs one kernel per row below TILE_ROWS rows of a stream and a
  tiled one from TILE_ROWS up: the scheduler keeps each kind of cell with its kernel
  (core/costmodel.py, `deterministic_chunk`).
K-quant weights switch kernel at 8 rows unless `GGML_CPU_TILED_MM_FORCE` is set
before llama.cpp first multiplies by them (`TILED_ENV`). Whether all of it holds on
this CPU and model is checked at start (`self_check`), not assumed.
"""
from __future__ import annotations

import numpy as np

from meshnode.core.types import GREEDY, Plan, SeqChunk
from meshnode.engine.llamacpp import INVARIANT_WEIGHTS

TILED_ENV = ("GGML_CPU_TILED_MM_FORCE", "1")
K_QUANTS = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
CHECK_PROMPT = 80  # >= TILE_ROWS: the check's prompt runs the tiled kernel, its decode rows the per-row one
CHECK_STEPS = 3


def promised(weight_types: set[str], system: str) -> bool:
    """Whether docs/determinism.md promises the mode for these weights on this CPU (`system`: llama.cpp's
    system info line): the formats the tests prove (llamacpp.INVARIANT_WEIGHTS) on an x86-64 CPU with AVX2,
    with or without AVX-512 (both measured). Elsewhere the start-up check decides alone; where the mode is
    promised and the check refuses, that is a regression, and the engine says so."""
    return bool(weight_types) and weight_types <= INVARIANT_WEIGHTS and "AVX2 = 1" in system


def pads(streams: list[int], n_streams: int) -> list[int]:
    """The streams that get a dummy row so that no run of consecutive streams holds one row alone
    (`streams`: each holds one row of the call; n_streams >= 2)."""
    taken, out = set(streams), []
    for s in sorted(streams):
        if s - 1 in taken or s + 1 in taken:
            continue
        d = s + 1 if s + 1 < n_streams else s - 1  # free: s is alone
        taken.add(d)
        out.append(d)
    return out


def self_check(engine, crowd: int = 8) -> str:
    """Run one sequence alone and beside 1 and `crowd` neighbours and compare its logits bitwise: ""
    when they agree, else what differed. A few hundred milliseconds on a small model; the KV is
    left empty."""
    n = engine.n_seq_max  # >= 2: EngineConfig.deterministic_problem
    toks = lambda k, base=0: (np.arange(base, base + k) % (engine.n_vocab - 3) + 3).astype(np.int32)  # noqa: E731
    prompt = toks(min(CHECK_PROMPT, engine.n_ctx_seq - CHECK_STEPS - 1))

    def run(others: list[int]) -> list[np.ndarray]:
        engine.step(Plan([], list(range(n))))
        out = [engine.logits_for(Plan([SeqChunk(0, 0, prompt, draw=0, sampling=GREEDY)]))[0]]
        for s in others:
            engine.logits_for(Plan([SeqChunk(s, 0, toks(3, 7 * s), draw=0, sampling=GREEDY)]))
        for k in range(CHECK_STEPS):
            t = np.array([int(np.argmax(out[-1]))], np.int32)
            rows = [SeqChunk(0, len(prompt) + k, t, draw=k + 1)]
            rows += [SeqChunk(s, 3 + k, toks(1, 5 * s + k), draw=k + 1) for s in others]
            out.append(engine.logits_for(Plan(rows))[0])
        return out

    alone = run([])
    crowds = {f"{len(o)} neighbour(s)": o for o in ([1], list(range(1, min(n, crowd + 1))))}
    problem = ""
    for what, others in crowds.items():
        got = run(others)
        bad = next((i for i, (a, b) in enumerate(zip(alone, got)) if not np.array_equal(a, b)), None)
        if bad is not None:
            problem = (f"a sequence's logits at step {bad} differed alone and beside {what} "
                       f"(max difference {float(np.max(np.abs(alone[bad] - got[bad]))):.3g})")
            break
    engine.step(Plan([], list(range(n))))
    return problem
