"""`python -m benchmarks kvroute`: which K/V cache types let a lone decode row keep its bits without a padding row,
and what each costs: speed by depth, prefill, and quality (perplexity) against llama-server's f16 K and V.

llama.cpp's CPU flash attention takes a split-KV path for one query row of one stream when K and V are both
f16 (or both f32) and the stream holds more than 256 cells; rows in company take the per-row kernel, which
sums in another order (engine/invariant.py). Any other pair avoids the split path, so a lone row needs no
padding row where the weights' one-column matmul sums like a many-column one (q8_0); but only an f16/f32
pair of one type takes the tiled kernel that prompt chunks of 64 rows and more run on. Per pair, in process
(llama-cpp-python's low-level API, the node's context settings, the model's weights as they are):
- bitwise: one sequence's logits over 24 teacher-forced steps past `--depth` cells, unpadded, alone and beside
  1, 2 and 7 neighbours;
- ms a token of a lone row at depths 256 to 4096 (median of 30 steps, best of 3 rounds from the same prefilled
  cells), and for f16/f16 also
  with the padding row deterministic mode adds (the node's cost today);
- a prompt's prefill in chunks of 512 (best of 3), 512 to 4096 tokens;
- perplexity of `--text` (default /usr/share/common-licenses/GPL-3) in windows of 512, the second half of each
  scored, beside f16/f16's.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from meshnode.bench import llama_build, model_path

PAIRS = (("f16", "f16"), ("q8_0", "f16"), ("f16", "q8_0"), ("q8_0", "q8_0"), ("bf16", "bf16"))
TYPES = {"f16": 1, "q8_0": 8, "bf16": 30}
DEPTHS = (256, 600, 1000, 2000, 4096)
PREFILLS = (512, 2048, 4096)
STREAMS, CELLS = 9, 4608 + 512
TEXT = "/usr/share/common-licenses/GPL-3"


class Context:
    """One llama.cpp context on streams with one K/V pair: decode calls of (seq, token, pos, logits?) rows."""

    def __init__(self, lc, model, threads: int, kv: tuple[str, str], cells: int = CELLS, streams: int = STREAMS):
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = streams * cells, 512, 512, streams
        cp.kv_unified, cp.flash_attn_type = False, 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k, cp.type_v, cp.no_perf = TYPES[kv[0]], TYPES[kv[1]], True
        self.lc, self.ctx = lc, lc.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError(f"no context for K {kv[0]} V {kv[1]}")
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        self.batch = lc.llama_batch_init(512 + 16, 0, 1)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (s, t, p, want) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = t, p, 1, s, want
        b.n_tokens = len(rows)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()

    def fill(self, seq: int, toks: list[int], start: int = 0, last_logits: bool = False) -> None:
        for p in range(0, len(toks), 512):
            part = toks[p:p + 512]
            self.decode([(seq, t, start + p + i, last_logits and p + i == len(toks) - 1) for i, t in enumerate(part)])

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, min(vocab, 20000), n)]


def bitwise(c: Context, depth: int) -> dict[int, bool]:
    steps = tokens(24, 9, c.n_vocab)

    def run(k: int) -> list[np.ndarray]:
        c.clear()
        c.fill(0, tokens(depth, 5, c.n_vocab))
        for s in range(1, k + 1):
            c.fill(s, tokens(20 + 5 * s, s, c.n_vocab))
        out = []
        for i, t in enumerate(steps):
            c.decode([(0, t, depth + i, True)] + [(s, 7 + s, 20 + 5 * s + i, True) for s in range(1, k + 1)])
            out.append(c.logits(0))
        return out

    alone = run(0)
    return {k: all(np.array_equal(a, b) for a, b in zip(alone, run(k))) for k in (1, 2, 7)}


def lone_ms(c: Context, depth: int, pad: bool) -> float:
    best = float("inf")
    c.clear()
    c.fill(0, tokens(depth, 1, c.n_vocab))
    for _ in range(3):
        c.lc.llama_memory_seq_rm(c.mem, 0, depth, -1)
        ts = []
        for i in range(30):
            rows = [(0, 5 + i, depth + i, True)] + ([(1, 3, 0, True)] if pad else [])
            t0 = time.perf_counter()
            c.decode(rows)
            ts.append(time.perf_counter() - t0)
            if pad:
                c.lc.llama_memory_seq_rm(c.mem, 1, 0, -1)
        best = min(best, float(np.median(ts)) * 1e3)
    return best


def prefill_ms(c: Context, n: int) -> float:
    best = float("inf")
    for _ in range(3):
        c.clear()
        t0 = time.perf_counter()
        c.fill(0, tokens(n, 2, c.n_vocab), last_logits=True)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def perplexity(c: Context, toks: list[int], window: int = 512) -> float:
    nll, n = 0.0, 0
    for w in range(0, len(toks) - window + 1, window):
        part = toks[w:w + window]
        c.clear()
        c.decode([(0, t, i, i >= window // 2 - 1) for i, t in enumerate(part)])
        for i in range(window // 2 - 1, window - 1):
            x = c.logits(i).astype(np.float64)
            nll += np.log(np.exp(x - x.max()).sum()) + x.max() - x[part[i + 1]]
            n += 1
    return float(np.exp(nll / n))


def main(a) -> int:
    import llama_cpp as lc

    from meshnode.engine import llamacpp

    path, threads = model_path(a), a.threads or os.cpu_count()
    text_path = os.environ.get("KVROUTE_TEXT", TEXT)
    text = open(text_path, encoding="utf-8").read()
    llamacpp.install_log()
    mp = lc.llama_model_default_params()
    mp.use_extra_bufts = False  # deterministic mode's weights: no repacked layouts
    model = lc.llama_model_load_from_file(path.encode(), mp)
    vocab = lc.llama_model_get_vocab(model)
    buf = (lc.llama_token * (len(text) + 16))()
    n = lc.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, len(buf), True, False)
    toks = list(buf[:n])
    depth = a.tokens * 19 if a.tokens != 32 else 600
    print(f"bench kvroute: {os.path.basename(path)}, threads {threads}; text {os.path.basename(text_path)} "
          f"({n} tokens, sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}); {llama_build()}", flush=True)
    out = {}
    for kv in PAIRS:
        c = Context(lc, model, threads, kv)
        try:
            row = {"bitwise": bitwise(c, depth), "lone_ms": {d: lone_ms(c, d, False) for d in DEPTHS},
                   "prefill_ms": {p: prefill_ms(c, p) for p in PREFILLS}, "perplexity": perplexity(c, toks)}
            if kv == ("f16", "f16"):
                row["padded_ms"] = {d: lone_ms(c, d, True) for d in DEPTHS}
        finally:
            c.close()
        out[f"{kv[0]}/{kv[1]}"] = row
        same = ", ".join(f"{k}: {'same' if v else 'differs'}" for k, v in row["bitwise"].items())
        print(f"  K {kv[0]:<4} V {kv[1]:<4} lone row unpadded at {depth} cells beside 1, 2, 7 neighbours: {same}; "
              f"perplexity {row['perplexity']:.4f}", flush=True)
        print("      lone ms a token by depth: " + "  ".join(f"{d}: {ms:.2f}" for d, ms in row["lone_ms"].items())
              + ("   padded: " + "  ".join(f"{d}: {ms:.2f}" for d, ms in row["padded_ms"].items())
                 if "padded_ms" in row else ""), flush=True)
        print("      prefill ms: " + "  ".join(f"{p}: {ms:.0f}" for p, ms in row["prefill_ms"].items()), flush=True)
    base = out["f16/f16"]
    for name, row in out.items():
        if name == "f16/f16":
            continue
        speed = "  ".join(f"{d}: {row['lone_ms'][d] / base['lone_ms'][d]:.2f}x" for d in DEPTHS)
        pre = "  ".join(f"{p}: {row['prefill_ms'][p] / base['prefill_ms'][p]:.2f}x" for p in PREFILLS)
        print(f"  {name} / f16/f16: lone decode {speed}; prefill {pre}; perplexity "
              f"{row['perplexity'] / base['perplexity'] - 1:+.3%}")
    print("  f16/f16 padded / unpadded (deterministic mode's padding row): "
          + "  ".join(f"{d}: {base['padded_ms'][d] / base['lone_ms'][d]:.2f}x" for d in DEPTHS))
    lc.llama_model_free(model)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "depth": depth,
                       "text": text_path, "text_tokens": n, "pairs": out}, f, indent=1)
    return 0
