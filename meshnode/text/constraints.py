"""Structured output: a session's `response_format` compiled to an llguidance grammar, in the front.

llguidance (the constraint engine llama.cpp and vLLM use) compiles JSON schemas, regexes and Lark
grammars; llama.cpp's GBNF is converted with its own `gbnf_to_lark`. Compiling here, before admission,
lets a schema the library rejects be answered with its message at once; the engine process builds its
own matcher from the compiled grammar (meshnode/engine/constraint.py), next to where it samples.

The tokenizer llguidance needs comes from the served GGUF's vocabulary (SPM and BPE alike), built from
the front's vocab-only load, so the masks agree with llama.cpp's tokens.
"""
from __future__ import annotations

import json

from meshnode.core.types import ResponseFormat

JSON_OBJECT = {"type": "object"}  # `json_object`: any JSON object, as OpenAI's and llama-server's json mode
# compact JSON (",", ":" and no whitespace between tokens): llguidance's default allows any run of
# whitespace anywhere, which a weak model fills until max_tokens; a schema's "x-guidance" can ask otherwise
JSON_OPTIONS = {"whitespace_flexible": False}


class Constraints:
    def __init__(self, vocab_ptr):
        """`vocab_ptr`: llama.cpp's llama_vocab of the served model (the front's vocab-only load)."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        self.tokenizer = lltokenizer_from_vocab(vocab_ptr)

    def compile(self, fmt: ResponseFormat) -> tuple[str, str]:
        """(grammar, "") for the engine, or ("", why the library refused it) for a BAD_REQUEST."""
        import llguidance as G

        try:
            if fmt.kind == "json_schema":
                grammar = G.LLMatcher.grammar_from_json_schema(json.loads(fmt.spec), defaults=JSON_OPTIONS)
            elif fmt.kind == "json_object":
                grammar = G.LLMatcher.grammar_from_json_schema(JSON_OBJECT, defaults=JSON_OPTIONS)
            elif fmt.kind == "regex":
                grammar = G.LLMatcher.grammar_from_regex(fmt.spec)
            else:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = G.LLMatcher.grammar_from_lark(gbnf_to_lark(fmt.spec))
        except Exception as e:  # the library's own parsers: a bad schema or grammar text
            return "", f"response_format: {e}"
        problem = G.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            return "", f"response_format: {problem}"
        return grammar, ""
