"""Structured output: a session's `response_format` compiled to an llguidance grammar, in the front.

llguidance (the constraint engine llama.cpp and vLLM use) compiles JSON schemas, regexes and Lark
grammars; llama.cpp's GBNF is converted with its own `gbnf_to_lark`. Compiling here, before admission,
lets a schema the library rejects be answered with its message at once; the engine process builds its
own matcher from the compiled grammar (meshnode/engine/constraint.py), next to where it samples.

The tokenizer llguidance needs comes from the served GGUF's vocabulary (SPM and BPE alike), built from
the front's vocab-only load, so the masks agree with llama.cpp's tokens.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

from meshnode.core.types import Grammar, ResponseFormat, library_words
from meshnode.engine import llamacpp

JSON_OBJECT = {"type": "object"}  # `json_object`: any JSON object, as OpenAI's and llama-server's json mode
# compact JSON (",", ":" and no whitespace between tokens): llguidance's default allows any run of
# whitespace anywhere, which a weak model fills until max_tokens; a schema's "x-guidance" can ask otherwise
JSON_OPTIONS = {"whitespace_flexible": False}
NO_MATCH = "no output can ever match it: no token may start the text"
KEEP = 256  # compiled formats kept: clients tend to send the same few schemas again and again


class Constraints:
    def __init__(self, vocab_ptr, max_bytes: int):
        """`vocab_ptr`: llama.cpp's llama_vocab of the served model (the front's vocab-only load);
        `max_bytes`: the largest compiled grammar the engine link carries in one message."""
        import llguidance

        self._g = llguidance
        self.tokenizer = llamacpp.constraint_tokenizer(vocab_ptr)
        self.max_bytes = max_bytes
        self._kept: OrderedDict[ResponseFormat, Grammar] = OrderedDict()

    def compile(self, fmt: ResponseFormat) -> tuple[Grammar | None, str]:
        """(grammar, "") for the engine, or (None, why the library refused it) for a BAD_REQUEST."""
        if fmt in self._kept:
            self._kept.move_to_end(fmt)
            return self._kept[fmt], ""
        text, why = self._compile(fmt)
        if why:
            return None, f"response_format: {why}"
        if len(text.encode()) > self.max_bytes:
            return None, f"response_format: compiled to {len(text.encode())} bytes, over the {self.max_bytes} the node carries"
        grammar = self._kept[fmt] = Grammar(hashlib.sha256(text.encode()).hexdigest()[:24], text)
        if len(self._kept) > KEEP:
            self._kept.popitem(last=False)
        return grammar, ""

    def _compile(self, fmt: ResponseFormat) -> tuple[str, str]:
        M = self._g.LLMatcher
        try:
            if fmt.kind == "json_schema":
                text = M.grammar_from_json_schema(json.loads(fmt.spec), defaults=JSON_OPTIONS)
            elif fmt.kind == "json_object":
                text = M.grammar_from_json_schema(JSON_OBJECT, defaults=JSON_OPTIONS)
            elif fmt.kind == "regex":
                text = M.grammar_from_regex(fmt.spec)
            elif fmt.kind == "lark":
                text = M.grammar_from_lark(fmt.spec)
            else:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                text = M.grammar_from_lark(gbnf_to_lark(fmt.spec))
        except Exception as e:  # the library's own parsers: a bad schema or grammar text
            return "", library_words(str(e))
        return text, library_words(M.validate_grammar(text, self.tokenizer) or self._first_token_problem(text))

    def _first_token_problem(self, text: str) -> str:
        """Why no output can start under the grammar ("" when some token may): a matcher the library cannot
        build (its limits, e.g. a rule of too many alternatives) or one that allows nothing (a regex or schema
        no text matches). Found here, the client hears it before admission; the engine checks every later
        token the same way (meshnode/engine/constraint.py)."""
        import llguidance.numpy as gn

        m = self._g.LLMatcher(self.tokenizer, text)
        if not m.is_error():
            mask = gn.allocate_token_bitmask(1, self.tokenizer.vocab_size)
            gn.fill_next_token_bitmask(m, mask, 0)
            if not m.is_error():
                return "" if mask.any() else NO_MATCH
        words = library_words(m.get_error())
        return NO_MATCH + f" ({words})" if words.startswith("NoExtensionBias") else words
