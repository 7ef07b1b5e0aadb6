"""Text <-> tokens in the front, through a vocab-only load of the served model.

A vocab-only load reads no weights, so the front stays small and never touches
the engine's context. Streamed pieces go through an incremental UTF-8 decoder
per session, because a byte-level vocab may split one character across tokens.

Cost is bounded, because clients choose the text. llama.cpp's SPM tokenizer
reallocates its whole output once per byte-fallback character
(llama-vocab.cpp, `resegment`: `output.reserve(output.size() + symbol.n)`),
so text made of characters the vocab lacks (tabs, CJK, emoji in a small
vocab) costs time quadratic in its length. A character that appears in no
token's text can never merge with a neighbour, so the text can be cut right
after it and each piece tokenized on its own with an identical result; cutting
every few KiB keeps each call's output short and the whole encode linear.
`min_tokens` is a lower bound that needs no tokenizing at all, for refusing a
text that cannot fit the context before paying for it.
"""
from __future__ import annotations

import codecs
import ctypes
import math
import re
from collections.abc import Iterator

from meshnode.core.types import FatalEngineError
from meshnode.engine import llamacpp
from meshnode.text import chat, jinja
from meshnode.text.chat import Chat, ChatPrompt
from meshnode.text.templatehost import TemplateHost

SPM = 1  # llama_vocab_type
SLICE_BYTES = 1024  # cut a text at most this often (at a character that never merges) to stay linear


class Tokenizer:
    def __init__(self, model_path: str):
        import llama_cpp as lc

        llamacpp.install_log()
        self._lc = lc
        mp = lc.llama_model_default_params()
        mp.vocab_only = True
        try:
            self._model = llamacpp.load_model(model_path, mp, "the tokenizer: ")
        except FatalEngineError as e:  # the front's own start fails: no engine to restart
            raise RuntimeError(str(e)) from None
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self._buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}  # the vocab is fixed: each piece is looked up once
        texts = [lc.llama_vocab_get_text(self._vocab, t) or b"" for t in range(self.n_vocab)]
        # no token covers more input bytes than its own text has (SPM's U+2581 stands for one space)
        self.max_token_bytes = max(1, max(len(t) for t in texts))
        self._never_merges = self._spm_foreign(texts)
        self.add_bos, self.bos = lc.llama_vocab_get_add_bos(self._vocab), lc.llama_vocab_bos(self._vocab)
        special = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_USER_DEFINED | lc.LLAMA_TOKEN_ATTR_UNKNOWN
        self._template = None  # the GGUF's chat template, compiled at the first chat request
        self._has_system = None  # whether it has a system role, probed at the first chat request
        self._specials = chat.Specials({texts[t].decode("utf-8", "replace"): t for t in range(self.n_vocab)
                                        if texts[t] and lc.llama_vocab_get_attr(self._vocab, t) & special})

    @property
    def vocab(self):
        """llama.cpp's llama_vocab pointer (for llguidance's tokenizer, meshnode/text/constraints.py)."""
        return self._vocab

    def _spm_foreign(self, texts: list[bytes]) -> re.Pattern | None:
        """A pattern matching any character no token's text contains, when the linear SPM path applies."""
        lc, v = self._lc, self._vocab
        if lc.llama_vocab_type(v) != SPM or lc.llama_vocab_get_add_eos(v):
            return None
        have = set(texts)
        if any(f"<0x{b:02X}>".encode() not in have for b in range(256)):
            return None  # no byte fallback: characters outside the vocab become <unk>, not bytes
        chars = {ch for t in texts for ch in t.decode("utf-8", "replace")} | {" "}  # a space is U+2581 to SPM
        return re.compile("[^" + "".join(re.escape(ch) for ch in sorted(chars)) + "]")

    def min_tokens(self, prompt: str | ChatPrompt | Chat) -> int:
        """A lower bound on the prompt's token count that costs nothing: no token covers more bytes (a chat's
        contents alone, before its template runs)."""
        if isinstance(prompt, str):
            return math.ceil(len(prompt.encode("utf-8")) / self.max_token_bytes)
        if isinstance(prompt, Chat):
            return sum(self.min_tokens(c) for c in prompt.contents())
        return sum(1 if isinstance(p, int) else self.min_tokens(p) for p in prompt.parts)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Exactly llama.cpp's tokens for `text` (special-token text such as </s> stays plain text), in
        time linear in its length."""
        return [t for part in self.slices(text, add_bos) for t in part]

    def slices(self, text: str, add_bos: bool = True) -> Iterator[list[int]]:
        """`encode(text)` a slice at a time (about SLICE_BYTES of text each), so a worker can take turns
        between clients' texts instead of finishing the longest first."""
        cuts = self._cuts(text) if self._never_merges is not None else []
        if not cuts:
            yield self._tokenize(text, add_bos)
            return
        yield self._tokenize(text[:cuts[0]], add_bos)
        start = cuts[0]
        for end in cuts[1:] + [len(text)]:
            # the piece follows a character that never merges: tokenize it behind that same
            # character, whose own tokens (and the space prefix SPM adds at the start) come off
            lead = text[start - 1]
            head = self._tokenize(lead, False)
            got = self._tokenize(lead + text[start:end], False)
            if got[:len(head)] != head:  # cannot happen for an SPM vocab; never guess
                raise ValueError("a cut changed the tokens")
            yield got[len(head):]
            start = end

    def prompt_slices(self, prompt: str | ChatPrompt | Chat) -> Iterator[list[int]]:
        """A submit's prompt, text or chat, a slice at a time (see `slices`); a Chat's template runs first
        (ValueError, in a sentence, where it refuses the messages)."""
        if isinstance(prompt, Chat):
            prompt = self.chat_prompt(prompt.messages, prompt.special_in_content, prompt.tools,
                                      prompt.add_generation_prompt, prompt.continue_final)
        if isinstance(prompt, str):
            yield from self.slices(prompt)
            return
        if self.add_bos:
            yield [self.bos]
        for part in prompt.parts:
            if isinstance(part, int):
                yield [part]
            else:  # plain text after a special token or at the start: llama.cpp tokenizes it on its own
                yield from self.slices(part, add_bos=False)

    def _cuts(self, text: str) -> list[int]:
        """Positions right after a never-merging character, at least SLICE_BYTES characters apart."""
        cuts, pos = [], SLICE_BYTES
        while (m := self._never_merges.search(text, pos)) is not None and m.end() < len(text):
            cuts.append(m.end())
            pos = m.end() + SLICE_BYTES
        return cuts

    def _tokenize(self, text: str, add_bos: bool, special: bool = False) -> list[int]:
        """llama_tokenize itself (quadratic on some texts: tests and short strings only)."""
        data = text.encode("utf-8")
        n_max = len(data) + 8
        out = (self._lc.llama_token * n_max)()
        n = self._lc.llama_tokenize(self._vocab, data, len(data), out, n_max, add_bos, special)
        if n < 0:
            raise ValueError("text did not tokenize")
        return list(out[:n])

    def format_chat(self, messages: list[dict]) -> str:
        """The messages in the model's own chat template, as one text (what llama-server tokenizes)."""
        return chat.render(self._apply_template, messages, self._system_role())

    def chat_prompt(self, messages: list[dict], special_in_content: bool = False, tools: list | None = None,
                    add_generation_prompt: bool | None = None, continue_final: bool | None = None) -> ChatPrompt:
        """The messages in the model's chat template, its own markers as special tokens and the clients'
        content as plain text (meshnode/text/chat.py says why); `tools` (ipc/chat.py's shape) listed by it;
        vLLM's `add_generation_prompt` and `continue_final_message` where given (chat.conversation)."""
        return chat.prompt(lambda msgs, opened=True: self._apply_template(msgs, tools, opened), self._specials,
                           messages, special_in_content, self._system_role(), tools, add_generation_prompt,
                           continue_final)

    def vocab_difference(self, path: str) -> str:
        """Why another GGUF's tokens are not this model's ("" when they are): a draft model's check, before
        the engine loads anything (engine/draftmodel.py checks again where it drafts)."""
        other = Tokenizer(path)
        try:
            return llamacpp.vocab_difference(other._vocab, self._vocab)
        finally:
            other.close()

    @property
    def tool_format(self) -> str:
        """How the model's template has it call tools (meshnode/text/jinja.py, `tool_format`)."""
        src = self._lc.llama_model_chat_template(self._model, None)
        return jinja.tool_format(src.decode("utf-8", "replace") if src else "")

    def _system_role(self) -> bool:
        """Whether the template renders a system message (probed once)."""
        if self._has_system is None:
            self._has_system = chat.has_system_role(self._apply_template)
        return self._has_system

    def special_prompt(self, text: str) -> ChatPrompt:
        """`text` with the vocab's special tokens it spells parsed as those tokens (llama-server's completions):
        for a client that templates its own prompts, where every character of it is its own."""
        return chat.parsed(self._specials, text)

    def _apply_template(self, messages: list[dict], tools: list | None = None, opened: bool = True) -> str:
        """The GGUF's own `tokenizer.chat_template` run over the messages, the assistant's turn opened
        (meshnode/text/jinja.py), in a child process of its own (meshnode/text/templatehost.py). ValueError, in
        a sentence, when there is none or it fails."""
        if self._template is None:
            src = self._lc.llama_model_chat_template(self._model, None)
            if not src:
                raise ValueError("the model has no chat template (tokenizer.chat_template); send text or tokens")
            self._template = TemplateHost(src.decode("utf-8", "replace"), self._special_text(self.bos),
                                          self._special_text(self._lc.llama_vocab_eos(self._vocab)), self.add_bos,
                                          self._lc.llama_vocab_get_add_eos(self._vocab))
        return self._template.render(messages, tools, opened)

    def _special_text(self, token: int) -> str:
        """A control token's own text (<|im_start|>, <s>), as the template's bos_token / eos_token."""
        if token < 0:
            return ""
        n = self._lc.llama_token_to_piece(self._vocab, token, self._buf, len(self._buf), 0, True)
        return self._buf.raw[:max(n, 0)].decode("utf-8", "replace")

    def piece(self, token: int) -> bytes:
        p = self._pieces.get(token)
        if p is None:
            n = self._lc.llama_token_to_piece(self._vocab, token, self._buf, len(self._buf), 0, False)
            p = self._pieces[token] = self._buf.raw[:max(n, 0)]
        return p

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def close(self) -> None:
        if self._template is not None:
            self._template.close()
        llamacpp.free(self)


class TextStream:
    """Turns a session's token pieces into text without splitting characters.

    A character split across tokens is held until it is complete; `end()` gives what is still held
    when the session ends (an incomplete character, as U+FFFD), so the pieces streamed always add
    up to the session's final text.
    """

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tokens: list[int]) -> str:
        return self.dec.decode(b"".join(self.tok.piece(t) for t in tokens))

    def end(self) -> str:
        return self.dec.decode(b"", final=True)
