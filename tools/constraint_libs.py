#!/usr/bin/env python
"""Why llguidance: its mask cost beside xgrammar's on the same vocabulary, schema and walk.

xgrammar needs torch (and transformers and triton), which a CPU node does not otherwise install, so
this runs in two steps, the second in a throw-away venv with both libraries:

  python tools/constraint_libs.py dump --preset bench-32k vocab.json         # the GGUF's token bytes
  VENV/bin/python tools/constraint_libs.py time vocab.json --json evidence/constraint-libs.json

`time` builds each library's tokenizer from the same token bytes, compiles the schema of `meshnode
bench structured` (compact JSON in both) and walks one answer of `--tokens` tokens, each drawn at
random from what llguidance allows and fed to both: the time to compile, and to fill one row's bitmask
at every step (each library into its own bitmask: the part of a constrained row that is the library's).
A token one library allows and the other refuses is counted.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time


def dump(a) -> int:
    import llama_cpp

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a checkout: its benchmarks/
    from benchmarks.structured import SCHEMA
    from meshnode.ops.models import cached_model

    path = a.model or str(cached_model(a.preset))
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    vocab = llama_cpp.llama_model_get_vocab(model)
    buf = (llama_cpp.ctypes.c_char * 256)()
    pieces = []
    for t in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        n = llama_cpp.llama_token_to_piece(vocab, t, buf, 256, 0, True)
        pieces.append(bytes(buf[:n]).hex())
    with open(a.out, "w") as f:
        json.dump({"model": path, "eos": llama_cpp.llama_vocab_eos(vocab), "tokens": pieces, "schema": SCHEMA}, f)
    llama_cpp.llama_model_free(model)
    print(f"{len(pieces)} tokens of {path} -> {a.out}")
    return 0


class _Bytes:
    """What llguidance's tokenizer wrapper needs: the token bytes, EOS, and a tokenize function (single
    bytes: every demo vocab has all 256 byte tokens)."""

    def __init__(self, tokens: list[bytes], eos: int):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self._byte = {tok[0]: i for i, tok in enumerate(tokens) if len(tok) == 1}

    def __call__(self, s: bytes) -> list[int]:
        return [self._byte[b] for b in s]


def timing(a) -> int:
    import llguidance as G
    import llguidance.numpy as GN
    import numpy as np
    import xgrammar as xgr

    with open(a.vocab) as f:
        d = json.load(f)
    tokens, eos, schema = [bytes.fromhex(h) for h in d["tokens"]], d["eos"], json.dumps(d["schema"])
    n = len(tokens)
    rng = np.random.default_rng(0)
    out = {"model": d["model"], "n_vocab": n, "tokens": a.tokens, "python": platform.python_version(),
           "machine": platform.processor() or platform.machine()}

    t0 = time.perf_counter()
    lt = G.LLTokenizer(G.TokenizerWrapper(_Bytes(tokens, eos)))
    out["llguidance_tokenizer_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    lm = G.LLMatcher(lt, G.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
    out["llguidance_compile_ms"] = (time.perf_counter() - t0) * 1e3
    lmask = GN.allocate_token_bitmask(1, lt.vocab_size)

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=n, stop_token_ids=[eos])
    out["xgrammar_tokenizer_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    out["xgrammar_compile_ms"] = (time.perf_counter() - t0) * 1e3
    xm = xgr.GrammarMatcher(compiled)
    xmask = xgr.allocate_token_bitmask(1, n)

    lms, xms, disagree = [], [], 0
    for _ in range(a.tokens):
        t0 = time.perf_counter()
        GN.fill_next_token_bitmask(lm, lmask, 0)
        lms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        xm.fill_next_token_bitmask(xmask)
        xms.append((time.perf_counter() - t0) * 1e3)
        lallowed = np.unpackbits(lmask[0].view(np.uint8), bitorder="little")[:n].astype(bool)
        xallowed = np.unpackbits(xmask[0].numpy().view(np.uint8), bitorder="little")[:n].astype(bool)
        disagree += int((lallowed != xallowed).any())
        tok = int(rng.choice(np.flatnonzero(lallowed & xallowed)))
        assert lm.consume_token(tok) and xm.accept_token(tok), tok
    for lib, ms in (("llguidance", lms), ("xgrammar", xms)):
        out[f"{lib}_mask_ms_median"] = float(np.median(ms))
        out[f"{lib}_mask_ms_p90"] = float(np.percentile(ms, 90))
        out[f"{lib}_mask_ms_max"] = float(np.max(ms))
    out["steps_where_the_masks_differ"] = disagree
    print(json.dumps(out, indent=1))
    print(f"mask per row, median (p90): llguidance {out['llguidance_mask_ms_median']:.3f} "
          f"({out['llguidance_mask_ms_p90']:.3f}) ms, xgrammar {out['xgrammar_mask_ms_median']:.3f} "
          f"({out['xgrammar_mask_ms_p90']:.3f}) ms; compile: llguidance {out['llguidance_compile_ms']:.1f} ms, "
          f"xgrammar {out['xgrammar_compile_ms']:.1f} ms; masks differed at {disagree} of {a.tokens} steps")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--preset", default="bench-32k")
    d.add_argument("--model")
    t = sub.add_parser("time")
    t.add_argument("vocab")
    t.add_argument("--tokens", type=int, default=256)
    t.add_argument("--json")
    a = p.parse_args()
    return dump(a) if a.cmd == "dump" else timing(a)


if __name__ == "__main__":
    sys.exit(main())
