"""A Hugging Face tokenizer folder made from a GGUF, for engines that tokenize themselves (NVIDIA Dynamo's
frontend renders the chat template and tokenizes before it routes; issue 68).

What a GGUF holds of its tokenizer becomes `tokenizer.json` (the `tokenizers` library's format), with
`tokenizer_config.json` (the chat template, BOS and EOS) and a `config.json` naming the model's kind and
context: the vocabulary and merges as they are; the special tokens (llama.cpp's control and user-defined
types) as added tokens; llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`, its regexes in llama-vocab.cpp, each
splitting the pieces of the one before) as a sequence of isolating splits ahead of the byte-level mapping.
Byte-level BPE vocabularies (`tokenizer.ggml.model` gpt2: SmolLM2, Qwen2, Llama 3, GPT-2) of the pre-tokenizers
listed in PRE are made; any other is refused naming what it is (SentencePiece vocabularies have their own
normalizer and byte fallback, not built here). tests/test_hf_folder.py checks that it tokenizes as llama.cpp
does on the real model's prompts.
"""
from __future__ import annotations

import json
import os

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's pre-tokenizer names -> its regexes, applied in order (llama-vocab.cpp, llm_tokenizer_bpe)
PRE = {"gpt2": [GPT2], "smollm": [r"\p{N}", GPT2], "llama3": [LLAMA3], "llama-bpe": [LLAMA3], "qwen2": [QWEN2]}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types that are special tokens


def _fields(path: str) -> dict:
    from gguf import GGUFReader

    r, out = GGUFReader(path), {}
    for name, f in r.fields.items():
        if not (name.startswith("tokenizer.") or name.endswith(".context_length") or name == "general.architecture"):
            continue
        if f.types and f.types[0].name == "ARRAY":
            out[name] = [_value(f.parts[i], f.types[-1].name) for i in f.data]
        else:
            out[name] = _value(f.parts[f.data[0]], f.types[0].name)
    return out


def _value(part, kind: str):
    return bytes(part).decode("utf-8") if kind == "STRING" else part.tolist()[0]


def write(model_path: str, out_dir: str) -> str:
    """The folder for the GGUF at `model_path`, written to `out_dir`; ValueError naming a tokenizer it cannot
    make. Returns `out_dir`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    f = _fields(model_path)
    kind, pre = f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE vocabularies (tokenizer.ggml.model gpt2) are made into a Hugging Face "
                         f"folder; this model's is {kind!r}: give one made from the model's own repository")
    if pre not in PRE:
        raise ValueError(f"llama.cpp's pre-tokenizer {pre!r} is not one this writer knows ({', '.join(PRE)}): give "
                         "a folder made from the model's own repository")
    tokens, types = f["tokenizer.ggml.tokens"], f.get("tokenizer.ggml.token_type", [])
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE[pre]] +
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    arch = f.get("general.architecture", "llama")
    ctx = f.get(f"{arch}.context_length")
    named = {k: tokens[f[f"tokenizer.ggml.{k}_token_id"]] for k in ("bos", "eos")
             if f"tokenizer.ggml.{k}_token_id" in f}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token")),
              "clean_up_tokenization_spaces": False, **({"model_max_length": ctx} if ctx else {}),
              **{f"{k}_token": v for k, v in named.items()},
              **({"chat_template": f["tokenizer.chat_template"]} if "tokenizer.chat_template" in f else {})}
    model = {"model_type": arch, "architectures": [f"{arch.capitalize()}ForCausalLM"], "vocab_size": len(tokens),
             **({"max_position_embeddings": ctx} if ctx else {}),
             **{f"{k}_token_id": f[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos")
                if f"tokenizer.ggml.{k}_token_id" in f}}
    for name, body in (("tokenizer_config.json", config), ("config.json", model)):
        with open(os.path.join(out_dir, name), "w") as fh:
            json.dump(body, fh, indent=1)
    return out_dir
