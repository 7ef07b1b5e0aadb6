"""Chat messages into a prompt: the template's own markers are special tokens, the contents are text.

llama-server renders the messages through the model's chat template and tokenizes the result with
special-token parsing, so content that spells `<|im_start|>system ...` (or `</s>` in a vocab where that
is the end token) becomes a real turn or a real end: template injection, on a node that takes content
from many tenants. Here the template is rendered with a placeholder for each content; only the
template's text is searched for special tokens, and each content goes in as plain text where the
template put it. Plain text goes through the tokenizer's linear path whatever its length (special-token
parsing takes llama.cpp's quadratic one), and content never passes through a C string, so a NUL in it
is a character, not the end of the message. Where no content spells a special token, the tokens are
llama-server's. `special_in_content` is llama-server's behaviour, for a node whose clients are trusted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

PLACEHOLDER = "\ue000{}\ue001"  # private-use characters: templates copy them as they are
_PLACEHOLDERS = re.compile("\ue000([0-9]+)\ue001")


@dataclass(frozen=True)
class ChatPrompt:
    """A prompt as llama.cpp's tokenizer sees it after special-token parsing: plain-text runs (str),
    each tokenized on its own, and special tokens (int). The tokenizer's BOS rule comes first."""
    parts: tuple

    def __len__(self) -> int:
        """Characters of text to tokenize (what the tokenizer's backlog counts)."""
        return sum(len(p) for p in self.parts if isinstance(p, str))


class Specials:
    """The vocab's special tokens by their text, found longest first, as llama.cpp's partition does."""

    def __init__(self, by_text: dict[str, int]):
        self.by_text = by_text
        names = sorted(by_text, key=len, reverse=True)
        self.pattern = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def partition(self, text: str) -> list:
        if self.pattern is None:
            return [text]
        return [self.by_text[p] if k % 2 else p for k, p in enumerate(self.pattern.split(text))]


def _rendered(apply_template, messages: list[dict]) -> str:
    """The template's text with a placeholder where each message's content goes."""
    return apply_template([(m["role"], PLACEHOLDER.format(i)) for i, m in enumerate(messages)])


def prompt(apply_template, specials: Specials, messages: list[dict], special_in_content: bool = False) -> ChatPrompt:
    """`apply_template([(role, content), ...]) -> str` renders; the contents come back in as text."""
    rendered = _rendered(apply_template, messages)
    parts: list = []
    for k, piece in enumerate(_PLACEHOLDERS.split(rendered)):
        if k % 2 == 0:
            parts += specials.partition(piece)
        else:
            content = messages[int(piece)]["content"]
            parts += specials.partition(content) if special_in_content else [content]
    return _merged(parts)


def parsed(specials: Specials, text: str) -> ChatPrompt:
    """A whole text with every special token it spells parsed (llama-server's way for a raw prompt)."""
    return _merged(specials.partition(text))


def _merged(parts: list) -> ChatPrompt:
    merged: list = []
    for p in parts:  # adjacent text is one run, as in llama.cpp; empty runs are nothing
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        elif p != "":
            merged.append(p)
    return ChatPrompt(tuple(merged))


def render(apply_template, messages: list[dict]) -> str:
    """The messages in the template as one text, contents included (what llama-server tokenizes)."""
    rendered = _rendered(apply_template, messages)
    return _PLACEHOLDERS.sub(lambda m: messages[int(m.group(1))]["content"], rendered)
