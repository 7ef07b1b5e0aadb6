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

import json
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


@dataclass(frozen=True)
class Chat:
    """A submit's messages before the template ran: what the front hands the tokenizer's worker, which renders
    them (Tokenizer.prompt_slices) off the front's loop. Fields as Tokenizer.chat_prompt takes them."""
    messages: list
    special_in_content: bool = False
    tools: list | None = None
    add_generation_prompt: bool | None = None
    continue_final: bool | None = None

    def contents(self) -> list[str]:
        return [m["content"] for m in self.messages if isinstance(m.get("content"), str)]

    def __len__(self) -> int:
        """Characters of content (what the tokenizer's backlog counts; the template's own text is small)."""
        return sum(len(c) for c in self.contents())


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


def conversation(messages: list[dict], system_role: bool = True,
                 continue_final: bool | None = None) -> tuple[list[dict], str | None]:
    """The messages as llama-server hands them to the template, and the text it continues with:
    - `developer` is `system` (every template but gpt-oss's);
    - a template without a system role (Gemma's raises on one) gets the system text at the head of the next
      message, or nothing where it stands alone;
    - a conversation ending with an assistant message is a prefill: the others are rendered with the
      assistant's turn opened and that message's content follows as it is, to be continued; unless
      `continue_final` is False (vLLM's continue_final_message: false), where it is a finished turn; two
      assistant messages at the end are refused then (ValueError, llama-server's words): which one goes on?"""
    msgs = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
    if msgs and msgs[0]["role"] == "system" and not system_role:
        head = msgs.pop(0)
        if msgs:
            msgs[0] = {**msgs[0], "content": head["content"] + "\n" + msgs[0]["content"]}
    prefill = None
    if continue_final is None and len(msgs) >= 2 and msgs[-1]["role"] == msgs[-2]["role"] == "assistant":
        raise ValueError("Cannot have 2 or more assistant messages at the end of the list.")
    if msgs and msgs[-1]["role"] == "assistant" and continue_final is not False:
        prefill = msgs.pop()["content"]
    return msgs, prefill


def has_system_role(apply_template) -> bool:
    """llama.cpp's probe: a system message whose text the template renders (once per template: its caller
    keeps the answer)."""
    probe = "\ue002system probe\ue003"
    try:
        return probe in apply_template([{"role": "system", "content": probe}, {"role": "user", "content": "x"}])
    except ValueError:
        return False


def _pieces(apply_template, messages: list[dict]) -> list:
    """The rendered conversation as template text (str) and contents ((message index, text)), in order.
    The template runs twice: with a placeholder for each content, to find where contents go, and with the
    contents themselves, to take each as the template wrote it (Llama 3's trims it, as llama-server then
    does; Llama 3.1 writes a tool result `tojson`, escaped); where the two cannot be lined up, every content
    goes in as the client sent it. An empty content stays empty: templates test it (Qwen2.5 opens a turn of
    tool calls with a newline only where there is text)."""
    marked = _PLACEHOLDERS.split(apply_template([{**m, "content": PLACEHOLDER.format(i) if m["content"] else ""}
                                                 for i, m in enumerate(messages)]))
    as_sent = [(int(x), messages[int(x)]["content"]) if k % 2 else x for k, x in enumerate(marked)]
    real = apply_template(messages)
    if not real.startswith(marked[0]):
        return as_sent
    out, pos = [marked[0]], len(marked[0])
    for k in range(1, len(marked), 2):
        i, after = int(marked[k]), marked[k + 1]
        c = messages[i]["content"]
        last = k + 2 >= len(marked)
        for cand in dict.fromkeys((c, c.strip(), c.rstrip(), c.lstrip(), json.dumps(c, ensure_ascii=False)[1:-1])):
            rest = real[pos + len(cand):]
            if real.startswith(cand, pos) and (rest == after if last else rest.startswith(after)):
                out += [(i, cand), after]
                pos += len(cand) + len(after)
                break
        else:  # the template did something else with this content
            return as_sent
    return out


def prompt(apply_template, specials: Specials, messages: list[dict], special_in_content: bool = False,
           system_role: bool = True, tools: list | None = None, add_generation_prompt: bool | None = None,
           continue_final: bool | None = None) -> ChatPrompt:
    """`apply_template([{role, content, ...}, ...], opened=True) -> str` renders (`opened`: the assistant's turn
    opened after the messages); the contents come back in as text.
    `system_role`: whether the template has one (`has_system_role`). Tool calls, tool results' ids and the
    tools the template lists are its text, searched for special tokens: one that spells a special token is
    refused (unless `special_in_content`), as a content spelling one would be a turn of its own."""
    if not special_in_content and specials.pattern is not None:
        spelled = specials.pattern.search(json.dumps([tools, [{k: v for k, v in m.items() if k != "content"}
                                                              for m in messages]], ensure_ascii=False))
        if spelled:
            raise ValueError(f"a tool, tool call or tool result id spells the special token {spelled.group(0)!r}, "
                             "which the template's text would turn into that token; this node keeps clients' "
                             "text literal (chat_special_in_content)")
    msgs, prefill = conversation(messages, system_role, continue_final)
    if add_generation_prompt is False and prefill is None:  # vLLM's: no assistant turn opened after the last one
        apply_template = (lambda render: lambda m: render(m, False))(apply_template)
    parts: list = []
    for piece in _pieces(apply_template, msgs):
        if isinstance(piece, str):
            parts += specials.partition(piece)
        else:
            parts += specials.partition(piece[1]) if special_in_content else [piece[1]]
    if prefill is not None:
        parts += specials.partition(prefill) if special_in_content else [prefill]
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


def render(apply_template, messages: list[dict], system_role: bool = True) -> str:
    """The messages in the template as one text, contents included (what llama-server tokenizes)."""
    msgs, prefill = conversation(messages, system_role)
    return "".join(p if isinstance(p, str) else p[1] for p in _pieces(apply_template, msgs)) + (prefill or "")
