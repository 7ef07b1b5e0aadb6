"""Text <-> tokens in the front, through a vocab-only load of the served model.

A vocab-only load reads no weights, so the front stays small and never touches
the engine's context. Streamed pieces go through an incremental UTF-8 decoder
per session, because a byte-level vocab may split one character across tokens.
"""
from __future__ import annotations

import codecs
import ctypes

from meshnode.engine.llama_engine import _install_log


class Tokenizer:
    def __init__(self, model_path: str):
        import llama_cpp as L

        _install_log()
        self._L = L
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        self._model = L.llama_model_load_from_file(model_path.encode(), mp)
        if not self._model:
            raise RuntimeError(f"cannot load the vocab of {model_path}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self.n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self._buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}  # the vocab is fixed: each piece is looked up once

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        out = (self._L.llama_token * n_max)()
        n = self._L.llama_tokenize(self._vocab, data, len(data), out, n_max, add_bos, False)
        if n < 0:
            raise ValueError("text did not tokenize")
        return list(out[:n])

    def piece(self, token: int) -> bytes:
        p = self._pieces.get(token)
        if p is None:
            n = self._L.llama_token_to_piece(self._vocab, token, self._buf, len(self._buf), 0, False)
            p = self._pieces[token] = self._buf.raw[:max(n, 0)]
        return p

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def close(self) -> None:
        if self._model:
            self._L.llama_model_free(self._model)
            self._model = None


class TextStream:
    """Turns a session's token pieces into text without splitting characters."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tokens: list[int]) -> str:
        return self.dec.decode(b"".join(self.tok.piece(t) for t in tokens))
