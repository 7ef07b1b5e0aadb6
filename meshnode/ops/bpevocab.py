"""A byte-level BPE vocabulary (GPT-2's scheme) for the demo models, so tests cover the other tokenizer
family real GGUFs use besides SentencePiece: llama.cpp's `gpt2` tokenizer model with its `gpt-2`
pre-tokenizer, the 256 byte symbols, merges that build common words, and ChatML markers as control tokens.
"""
from __future__ import annotations

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # BOS = EOS = <|endoftext|>, as GPT-2's


def byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode: each byte as a printable character (a space is 'Ġ')."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def letter_words():
    """Every two- and three-letter lowercase word, for vocabularies larger than the real words fill: a
    32k vocab of such pieces has a token trie as deep and as wide as a real one's, which is what a
    structured-output mask's cost depends on (tests/test_structured.py, `python -m benchmarks structured`)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    yield from (a + b for a in letters for b in letters)
    yield from (a + b + c for a in letters for b in letters for c in letters)


def build_bpe_vocab(n_vocab: int, words) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the byte symbols, then each word with and without a leading space
    built one character at a time by merges (so "Ġthe" comes from Ġ+t, Ġt+h, Ġth+e), padded with unused
    tokens, and the special tokens last."""
    from gguf import TokenType

    sym = byte_symbols()
    tokens, types, merges = list(sym), [int(TokenType.NORMAL)] * 256, []
    known = set(tokens)
    room = n_vocab - len(SPECIALS)
    for word in words:
        for piece in ("".join(sym[b] for b in (" " + word).encode()), word):
            for k in range(2, len(piece) + 1):
                if len(tokens) >= room:
                    break
                if piece[:k] in known:
                    continue
                merges.append(f"{piece[:k - 1]} {piece[k - 1]}")
                tokens.append(piece[:k])
                types.append(int(TokenType.NORMAL))
                known.add(piece[:k])
    i = 0
    while len(tokens) < room:
        tokens.append(f"<unused{i}>")
        types.append(int(TokenType.UNUSED))
        i += 1
    tokens += list(SPECIALS)
    types += [int(TokenType.CONTROL)] * len(SPECIALS)
    return tokens, types, merges
