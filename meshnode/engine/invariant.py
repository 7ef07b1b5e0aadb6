"""Deterministic mode on the stock llama.cpp build: the batch shapes that keep a sequence's numbers its own.

llama.cpp's CPU kernels give a row the same bits whatever else is in its call, with
these exceptions, which this module works around (docs/determinism.md has the source lines):
- a matmul of ONE column leaves llamafile's tinyBLAS for `ggml_vec_dot`, which sums
  f16 and f32 weights in another order (q8_0's sum the same); every 2 or more
  columns give the same bits;
- flash attention takes a split-KV path for ONE query row of one stream when K and
  V are both f16 (or both f32) and the stream holds more than SPLIT_KV_CELLS cells;
  several rows or streams take the per-row kernel, which sums in another order.
On per-sequence streams llama.cpp runs one ubatch per run of consecutive streams, so
a decode row alone in its run is such a lone row where either applies (`LonePads`:
which ones, decided at start by `self_check`): it gets a dummy row on an adjacent
stream (`pads`), removed after the call. A ubatch asks for logits on 0 or >= 2 rows
(the last layer's FFN and the output projection run only on those). Flash attention
runs one kernel per row below TILE_ROWS rows of a stream and a tiled one from
TILE_ROWS up (K and V of one f16/f32 type): the scheduler keeps each kind of cell
with its kernel (core/costmodel.py, `deterministic_chunk`). K-quant weights switch
kernel at 8 rows unless `GGML_CPU_TILED_MM_FORCE` is set before llama.cpp first
multiplies by them (`TILED_ENV`). Whether all of it holds on this CPU and model is
checked at start, not assumed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshnode.core.types import GREEDY, Keep, Plan, SeqChunk
from meshnode.engine.llamacpp import INVARIANT_WEIGHTS

TILED_ENV = ("GGML_CPU_TILED_MM_FORCE", "1")
# on a build with patches/0003, flash attention's split-KV path turned off (read once, when llama.cpp first needs
# it): a lone row past SPLIT_KV_CELLS then takes the per-row kernel a row beside others takes, and pays no pad
SPLIT_OFF_ENV = ("GGML_CPU_FA_SPLIT_KV", "0")
K_QUANTS = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
# weights whose one-column matmul sums like a many-column one on x86 (q8_0: ggml_vec_dot_q8_0_q8_0 and
# tinyBLAS_Q0 both sum each block's int32 dot and scale it in order; Q4_1 has no tinyBLAS kernel: ggml_vec_dot
# at any width); K-quants with TILED_ENV run the tiled kernel at one row too
ONE_COLUMN_SAME = frozenset({"Q8_0", "Q4_1"}) | K_QUANTS
SPLIT_KV_TYPES = frozenset({"f16", "f32"})  # K and V both of one of these: the split-KV path exists
SPLIT_KV_CELLS = 256  # n_kv is a stream's cells padded to 256; the split-KV path needs n_kv >= 512
CHECK_PROMPT = 80  # >= TILE_ROWS: the check's prompt runs the tiled kernel, its decode rows the per-row one
CHECK_STEPS = 3


@dataclass(frozen=True)
class LonePads:
    """Which decode rows alone in their run of streams need a padding row: `shallow` ones, at a position below
    SPLIT_KV_CELLS (where the weights' one-column matmul sums otherwise), and `deep` ones (that, or flash
    attention's split-KV path)."""
    shallow: bool
    deep: bool

    def at(self, pos: int) -> bool:
        """Whether a lone row at `pos` (its stream holds pos + 1 cells with it) needs one."""
        return self.deep if pos >= SPLIT_KV_CELLS else self.shallow

    def __bool__(self) -> bool:
        return self.shallow or self.deep


def expected_pads(weight_types: set[str], type_k: str, type_v: str, amx_f16: bool, threads: int = 2,
                  split_off: bool = False) -> LonePads:
    """The lone rows the kernels are known to treat otherwise (the start-up check has the last word):
    weights whose one column takes another kernel, at any depth; K and V of one f16/f32 type, past
    SPLIT_KV_CELLS, where the split-KV path splits the cells over more than one thread (on one it sums as
    the per-row kernel does; `split_off`: the build can turn it off, SPLIT_OFF_ENV). `amx_f16`: f16 weights in
    AMX buffers, whose kernel sums a row alike at any width."""
    same = ONE_COLUMN_SAME | ({"F16"} if amx_f16 else frozenset())
    shallow = not weight_types <= same
    split = type_k == type_v and type_k in SPLIT_KV_TYPES and threads != 1 and not split_off
    return LonePads(shallow, shallow or split)


def lone_cost(weight_types: set[str], type_k: str, type_v: str, amx_f16: bool, threads: int = 2,
              split_off: bool = False) -> str:
    """Why deterministic mode would make a session decoding alone slower ("" where it is free): a padding
    row makes its tick a two-row one (on a CPU, 1.6-2.2x a token: docs/determinism.md), and K-quant weights
    run the tiled kernel at one row. Said where the default leaves the mode off, with the ways to have it."""
    pads = expected_pads(weight_types, type_k, type_v, amx_f16, threads, split_off)
    fix = "; --deterministic requires it anyway"
    if pads.shallow:
        kinds = ", ".join(sorted(weight_types - ONE_COLUMN_SAME))
        return (f"a session decoding alone would pay a padding row every token ({kinds} weights: one column takes "
                f"another matmul kernel than two){fix} (docs/determinism.md)")
    if pads.deep:
        return (f"a session decoding alone would pay a padding row every token past {SPLIT_KV_CELLS} "
                f"(flash attention's split-KV path on a {type_k} K and V cache){fix}, or --cache-type-k q8_0 "
                "makes it free (docs/determinism.md)")
    if weight_types & K_QUANTS:
        return (f"K-quant weights ({', '.join(sorted(weight_types & K_QUANTS))}) would run their tiled kernel for "
                f"a lone row, several times slower{fix} (docs/determinism.md)")
    return ""


def promised(weight_types: set[str], system: str) -> bool:
    """Whether docs/determinism.md promises the mode for these weights on this CPU (`system`: llama.cpp's
    system info line): the formats the tests prove (llamacpp.INVARIANT_WEIGHTS) on an x86-64 CPU with AVX2,
    with or without AVX-512 (both measured). Elsewhere the start-up check decides alone; where the mode is
    promised and the check refuses, that is a regression, and the engine says so."""
    return bool(weight_types) and weight_types <= INVARIANT_WEIGHTS and "AVX2 = 1" in system


def pads(rows: list[tuple[int, int]], n_streams: int, lone: LonePads) -> list[int]:
    """The streams that get a dummy row so that no run of consecutive streams holds one row alone where
    `lone` says it needs one (`rows`: each (stream, position) holds one row of the call; n_streams >= 2)."""
    taken, out = {s for s, _ in rows}, []
    for s, pos in sorted(rows):
        if s - 1 in taken or s + 1 in taken or not lone.at(pos):
            continue
        d = s + 1 if s + 1 < n_streams else s - 1  # free: s is alone
        taken.add(d)
        out.append(d)
    return out


def self_check(engine, expected: LonePads, crowd: int = 8) -> tuple[str, LonePads]:
    """Which lone rows need a padding row on this CPU and model, and "" or what differed where even a padded
    row's bits move with its neighbours. One sequence runs alone and beside 1 and `crowd` neighbours, its
    logits compared bitwise, first with its lone rows unpadded, then padded, at a shallow position and (where
    a stream reaches it) past SPLIT_KV_CELLS. A model whose logits are all equal shows no difference either
    way: it gets the `expected` pads. Sets `engine.lone_pads` to the answer; the KV is left empty."""
    if _flat(engine):
        engine.lone_pads = expected
        return "", expected
    depths = {"shallow": CHECK_PROMPT}
    if engine.n_ctx_seq > SPLIT_KV_CELLS + CHECK_STEPS + 1:
        depths["deep"] = SPLIT_KV_CELLS + 1
    found = {}
    for where, n in depths.items():
        for pad in (False, True):
            engine.lone_pads = LonePads(pad, pad)
            problem = _compare(engine, n, crowd)
            if not problem:
                found[where] = pad
                break
        else:
            engine.lone_pads = LonePads(True, True)
            return f"{problem} (a prompt of {n} tokens)", engine.lone_pads
    engine.lone_pads = LonePads(found["shallow"], found.get("deep", found["shallow"]))
    return "", engine.lone_pads


def _flat(engine) -> bool:
    """Whether the model's logits are all equal (tests' models whose every draft is right)."""
    engine.step(Plan([], list(range(engine.n_seq_max))))
    got = engine.logits_for(Plan([SeqChunk(0, 0, np.arange(3, 7, dtype=np.int32), draw=0, sampling=GREEDY)]))[0]
    engine.step(Plan([], [0]))
    return bool(np.ptp(got) == 0)


def _compare(engine, n_prompt: int, crowd: int) -> str:
    """One sequence's logits over an n_prompt-token prompt and CHECK_STEPS decode steps, alone and beside
    neighbours: "" when they agree bitwise, else what differed."""
    n = engine.n_seq_max  # >= 2: EngineConfig.deterministic_problem
    toks = lambda k, base=0: (np.arange(base, base + k) % (engine.n_vocab - 3) + 3).astype(np.int32)  # noqa: E731
    prompt = toks(min(n_prompt, engine.n_ctx_seq - CHECK_STEPS - 1))
    # the prompt in chunks that are the same in every run: only the decode rows' company changes
    step = min(engine.n_batch, max(64, engine.n_batch // 2))

    engine.step(Plan([], list(range(n))))
    for p in range(0, len(prompt), step):  # once: every run starts from these cells, its decode rows cut after
        got = engine.logits_for(Plan([SeqChunk(0, p, prompt[p:p + step], draw=0 if p + step >= len(prompt) else -1,
                                               sampling=GREEDY if p == 0 else None)]))
    first = got[0]

    def run(others: list[int]) -> list[np.ndarray]:
        engine.step(Plan([], [s for s in range(1, n)], [Keep(0, len(prompt))]))
        out = [first]
        for s in others:
            engine.logits_for(Plan([SeqChunk(s, 0, toks(3, 7 * s), draw=0, sampling=GREEDY)]))
        for k in range(CHECK_STEPS):
            t = np.array([int(np.argmax(out[-1]))], np.int32)
            rows = [SeqChunk(0, len(prompt) + k, t, draw=k + 1, sampling=GREEDY if k == 0 else None)]
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
