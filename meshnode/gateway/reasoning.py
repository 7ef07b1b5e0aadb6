"""A reasoning model's thought, parsed out of its answer as it streams (llama-server's --reasoning-format).

Reasoning models (DeepSeek-R1 and its distills, Qwen3, QwQ) think inside `<think>...</think>` before they
answer; their templates often open the tag in the generation prompt, so the answer begins inside the thought
and only the closing tag shows. `reasoning_format` says what the gateway makes of it:
- `none`: the text as the model wrote it, tags and all, in `content`;
- `auto` (the default) and `deepseek` (llama-server's name for the same): the thought goes to
  `reasoning_content` (chat), a reasoning item (Responses), a thinking block (Messages); `content` never holds
  a tag. A thought counts where the answer opens one, or where the rendered prompt ended inside one (the
  node's `echo`: its last tokens, as text). A model that never writes the tags is not touched.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("none", "auto", "deepseek")
START, THOUGHT, AFTER, CONTENT = range(4)


def parses(fmt: str) -> bool:
    return fmt != "none"


def opened_in(prompt_tail: str) -> bool:
    """The rendered prompt leaves the answer inside a thought (its template opened the tag)."""
    return prompt_tail.rstrip().endswith(OPEN)


class Thought:
    """One answer's text, fed as it comes, split into (reasoning, content) pieces to send now. Text that may
    still turn out to be a tag is held back until the next piece (or the end) decides it."""

    def __init__(self, opened: bool = False):
        self.state, self.held = (THOUGHT if opened else START), ""

    def feed(self, text: str) -> tuple[str, str]:
        s, self.held = self.held + text, ""
        reasoning = content = ""
        while s:
            if self.state == START:  # the answer's first visible text: a thought opens, or it is all content
                t = s.lstrip()
                if t.startswith(OPEN):
                    self.state, s = THOUGHT, t[len(OPEN):]
                elif OPEN.startswith(t):  # whitespace, or the tag's beginning: not decided yet
                    self.held = s
                    return reasoning, content
                else:
                    self.state = CONTENT
            elif self.state == THOUGHT:
                i = s.find(CLOSE)
                if i >= 0:
                    reasoning, s, self.state = reasoning + s[:i], s[i + len(CLOSE):], AFTER
                    continue
                keep = _partial(s, CLOSE)
                reasoning, self.held = reasoning + s[:len(s) - keep], s[len(s) - keep:]
                return reasoning, content
            elif self.state == AFTER:  # the answer after a thought starts at its first visible character
                t = s.lstrip()
                if not t:
                    return reasoning, content
                self.state, s = CONTENT, t
            else:
                content, s = content + s, ""
        return reasoning, content

    def end(self) -> tuple[str, str]:
        """What was held back, at the answer's end: a thought's tail is reasoning, anything else content."""
        held, self.held = self.held, ""
        if self.state == THOUGHT:
            return held, ""
        return "", held.lstrip() if self.state in (START, AFTER) else held


def _partial(s: str, tag: str) -> int:
    """How many of `s`'s last characters are the beginning of `tag` (held back: the rest may come next)."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if tag.startswith(s[-k:]):
            return k
    return 0


class Split:
    """One answer's text as it comes, as (thought, the rest) pieces to send now, both also kept whole for the end.
    Without a Thought (nothing is parsed) every piece is the rest, as it came."""

    def __init__(self, thought: Thought | None = None):
        self.thought, self._thinking, self._said = thought, [], []

    def feed(self, text: str) -> tuple[str, str]:
        return self._keep(*(self.thought.feed(text) if self.thought else ("", text)))

    def end(self) -> tuple[str, str]:
        return self._keep(*(self.thought.end() if self.thought else ("", "")))

    def _keep(self, thought: str, text: str) -> tuple[str, str]:
        self._thinking.append(thought)
        self._said.append(text)
        return thought, text

    @property
    def reasoning(self) -> str:
        return "".join(self._thinking)

    @property
    def content(self) -> str:
        return "".join(self._said)


def split_of(req, prompt: list[int] | None, piece) -> Split:
    """The split for one answer of `req` (gateway/api.py Request): a thought parsed unless its format says none,
    it is a text completion (its prompt is the client's own) or a tools answer (its grammar admits no tag).
    `prompt`: its ids as the node rendered them (`echo`), whose last ones say whether the template opened a
    thought; `piece` names them."""
    if not parses(req.reasoning) or not req.chat or req.tools is not None:
        return Split()
    tail = b"".join(map(piece, prompt[-8:])).decode("utf-8", "replace") if prompt and piece else ""
    return Split(Thought(opened_in(tail)))
