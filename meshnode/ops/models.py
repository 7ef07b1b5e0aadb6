"""Deterministic demo GGUF models: a Llama architecture with random weights.

Nothing is ever downloaded, so tests, demos and benchmarks need a model they can
write themselves. The files are real Llama GGUFs (llama.cpp loads them like any
other), the vocab is a byte-level SPM vocab so any text tokenizes, and the same
seed always yields a byte-identical file so recipe fingerprints are stable.

Weights are scaled so greedy generations are non-degenerate: the residual stream
keeps unit RMS, and the output projection spreads logits with a std of about 3,
which keeps the top-1 margin far above the ~1e-4 noise of batched matmuls.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Preset:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    dtype: type
    vocab: str = "spm"  # spm: byte-level SentencePiece (llama); bpe: GPT-2 byte-level BPE (meshnode/ops/bpevocab.py)


PRESETS = {
    # a few MB, f32 so the numpy reference engine can match llama.cpp to 1e-3; trained context
    # 64K so a test node can take a prompt the size of the protocol's largest text
    "tiny": Preset(4, 256, 4, 2, 512, 512, 65536, np.float32),
    # the same shape in f16 (and, through --quant, in the formats users run): llama.cpp takes other
    # kernels for each, which matters for what deterministic mode can promise
    "tiny-f16": Preset(4, 256, 4, 2, 512, 512, 65536, np.float16),
    # the same shape with a byte-level BPE vocab (gpt2 tokenizer, ChatML markers as control tokens)
    "tiny-bpe": Preset(4, 256, 4, 2, 512, 512, 65536, np.float32, "bpe"),
    # ~270 MB f16: decode is bound by reading weights, as with real models
    "bench": Preset(12, 1024, 16, 4, 2816, 512, 4096, np.float16),
    # the bench shape with a 32k byte-level BPE vocab (real words, then every 2- and 3-letter piece): where a
    # vocabulary-wide cost shows (structured output's masks, sampling), as with real models' 32k-150k vocabs
    "bench-32k": Preset(12, 1024, 16, 4, 2816, 32768, 4096, np.float16, "bpe"),
    # the bench shape trained (as its metadata says) to 32k positions: one session deep in a context
    "bench-long": Preset(12, 1024, 16, 4, 2816, 512, 32768, np.float16),
}

WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this "
         "from or had by word but what some we can out other were all there when up use your how "
         "said an each she which do their time if will way about many then them write would like "
         "so these her long make thing see him two has look more day could go come did number "
         "sound no most people my over know water than call first who may down side been now find "
         "node mesh token batch model serve").split()

SPACE = "\u2581"  # SentencePiece's visible space


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
FORMAT = "chatml"  # what the files carry besides the preset's shape: a change makes cached files new ones


def build_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then word pieces up to n_vocab.

    Byte tokens guarantee every string tokenizes; pieces (scored by length so SPM
    merges prefer them) make ordinary text compact, as with a real SPM vocab.
    """
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = [SPACE] + [chr(c) for c in range(33, 127)]
    pieces += [SPACE + chr(c) for c in range(97, 123)]
    pieces += [SPACE + w for w in WORDS]
    seen = set()
    for p in pieces:
        if len(tokens) >= n_vocab:
            break
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(TokenType.NORMAL)
    i = 0
    while len(tokens) < n_vocab:  # pad with unused pieces so n_vocab is exact
        tokens.append(f"<unused{i}>")
        types.append(TokenType.UNUSED)
        i += 1
    scores = [0.0 if t != TokenType.NORMAL else float(len(tok)) for tok, t in zip(tokens, types)]
    return tokens, scores, [int(t) for t in types]


def _weights(p: Preset, rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    d, hd = p.n_embd, p.n_embd // p.n_head
    out = []

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))
        return w.astype(p.dtype)

    def norm(n: int) -> np.ndarray:  # norms stay f32, as in every real GGUF
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    out.append(("token_embd.weight", rng.standard_normal((p.n_vocab, d), dtype=np.float32).astype(p.dtype)))
    resid = 1.0 / np.sqrt(2 * p.n_layer)
    for i in range(p.n_layer):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", norm(d)),
            (b + "attn_q.weight", mat(p.n_head * hd, d, 2.0)),
            (b + "attn_k.weight", mat(p.n_head_kv * hd, d, 2.0)),
            (b + "attn_v.weight", mat(p.n_head_kv * hd, d)),
            (b + "attn_output.weight", mat(d, p.n_head * hd, resid)),
            (b + "ffn_norm.weight", norm(d)),
            (b + "ffn_gate.weight", mat(p.n_ff, d)),
            (b + "ffn_up.weight", mat(p.n_ff, d)),
            (b + "ffn_down.weight", mat(d, p.n_ff, resid)),
        ]
    out.append(("output_norm.weight", norm(d)))
    out.append(("output.weight", mat(p.n_vocab, d, 3.0)))
    return out


QUANTS = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q4_k_m": 15, "q6_k": 18}  # llama_ftype: LLAMA_FTYPE_MOSTLY_*


def _add_vocab(w, p) -> None:
    """The preset's tokenizer: a byte-level BPE one (GPT-2 style, as most instruct models have) or a
    SentencePiece-style one."""
    if p.vocab == "bpe":
        from meshnode.ops.bpevocab import SPECIALS, build_bpe_vocab, letter_words

        tokens, types, merges = build_bpe_vocab(p.n_vocab, [*WORDS, *letter_words()])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index(SPECIALS[0]))
        w.add_eos_token_id(tokens.index(SPECIALS[0]))
        w.add_add_bos_token(False)
    else:
        tokens, scores, types = build_vocab(p.n_vocab)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)


def make_model(path: str | os.PathLike, preset: str = "tiny", seed: int = 0, quant: str | None = None,
               chat_template: bool | str = True, flat: bool = False) -> Path:
    """Write the preset's GGUF to `path` atomically (a half-written model never loads); `quant` runs it
    through llama.cpp's own quantizer, as users' models are made. `chat_template`: ChatML, or a template's
    Jinja source (tests of other families' templates); False: a model
    without one, as many base models are (tests). `flat`: every output weight 0, so every logit is equal
    and greedy decoding repeats one token (what deterministic mode's drafts do when always right)."""
    if quant is not None:
        return _quantized(Path(path), preset, seed, quant, flat)
    import gguf

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"meshnode-demo-{preset}-seed{seed}")
    w.add_context_length(p.n_ctx_train)
    w.add_embedding_length(p.n_embd)
    w.add_block_count(p.n_layer)
    w.add_feed_forward_length(p.n_ff)
    w.add_head_count(p.n_head)
    w.add_head_count_kv(p.n_head_kv)
    w.add_rope_dimension_count(p.n_embd // p.n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(p.n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if p.dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16)
    _add_vocab(w, p)
    w.add_add_eos_token(False)
    if chat_template:
        # so `messages` work on the demo models (the vocab has no ChatML tokens: bytes)
        w.add_chat_template(CHATML if chat_template is True else chat_template)
    rng = np.random.default_rng(seed)
    for name, arr in _weights(p, rng):
        w.add_tensor(name, np.zeros_like(arr) if flat and name == "output.weight" else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def _quantized(path: Path, preset: str, seed: int, quant: str, flat: bool = False) -> Path:
    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r}; choose one of {sorted(QUANTS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.with_name(path.name + f".src{os.getpid()}")
    make_model(src, preset, seed, flat=flat)
    try:
        return quantize(src, path, QUANTS[quant])
    finally:
        if src.exists():
            src.unlink()


def quantize(src: Path, path: Path, ftype: int, requantize: bool = False) -> Path:
    """`src` through llama.cpp's own quantizer into `path` (a llama_ftype), written atomically: a half-written
    model is never found. `requantize`: the source is quantized already (llama.cpp's allow_requantize)."""
    import llama_cpp as lc

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    params = lc.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = ftype, os.cpu_count() or 1, requantize
    try:
        if lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {src.name} into {path.name}")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def cache_base(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where models made once are kept: `cache_dir`, else $MESHNODE_CACHE, else ~/.cache/meshnode."""
    return Path(cache_dir or os.environ.get("MESHNODE_CACHE") or Path.home() / ".cache" / "meshnode")


def cached_model(preset: str = "tiny", seed: int = 0, cache_dir: str | os.PathLike | None = None,
                 quant: str | None = None) -> Path:
    """The demo model in a cache dir, written once; used when no --model is given."""
    base = cache_base(cache_dir)
    # the preset's shape is in the name: a cache written by an older definition is never reused
    shape = hashlib.sha256((repr(PRESETS[preset]) + FORMAT).encode()).hexdigest()[:8]
    path = base / f"demo-{preset}-seed{seed}-{shape}{'-' + quant if quant else ''}.gguf"
    if not path.exists():
        make_model(path, preset, seed, quant)
    return path
