"""The model's own chat template: the GGUF's Jinja `tokenizer.chat_template`, rendered the way Hugging Face's
`apply_chat_template` and llama-server (Jinja by default) render it.

llama.cpp's `llama_chat_apply_template` does not run the template: it guesses the model family from the
template's text and writes that family's format, so whatever else the template does is lost (SmolLM2's adds
a default system turn when none is given: llama-server renders "hi" as 31 prompt tokens, the guess as 10,
and their greedy answers differ). Here the template runs in jinja2's immutable sandbox (a template is data
from the model file: no attribute access into Python, no mutation of what it is given) with what HF passes:
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `raise_exception`, `strftime_now`
and the `tojson` filter, and what llama-server adds: today's `date_string` and `datetime`. As llama.cpp
does, a BOS the template writes is dropped where the tokenizer adds one itself (and an EOS at the end where
it adds that): no token twice.
"""
from __future__ import annotations

import json
import time
from datetime import datetime

now = datetime.now  # the clock the template's dates come from (tests set the day a reference was recorded)


TOOL_FORMATS = ("generic", "hermes", "llama3")


def tool_format(source: str) -> str:
    """How a template has its model call tools, told by what it writes (llama-server's chat handlers tell them
    the same way): `hermes` (Qwen2.5, Hermes 2 Pro: `<tool_call>{"name", "arguments"}</tool_call>`), `llama3`
    (Llama 3.1-3.3: a JSON object `{"name", "parameters"}`), else `generic` (the gateway's own JSON form, the
    tools in the system turn: gateway/tools.py), which also serves templates whose calls open with a control
    token (Mistral's `[TOOL_CALLS]`)."""
    if "<tool_call>" in source and "tools" in source:
        return "hermes"
    if "<|python_tag|>" in source or ("ipython" in source and '"parameters"' in source and "tools" in source):
        return "llama3"
    return "generic"


class TemplateError(ValueError):
    """The template could not render these messages (its own `raise_exception`, or a Jinja error): the
    request is refused with these words, never guessed at."""


def _raise(message: str):
    raise TemplateError(f"the model's chat template refused the messages: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


# a render's CPU time: real templates take about a millisecond, but a render may also pay a first import or a
# collection (a 50 ms bound refused Llama 3.1's template once in a suite run); a loop of 1e10 froze the front
MAX_RENDER_CPU_S = 0.25
MAX_POWER = 64  # the largest exponent a template's ** computes: 9 ** 9 ** 9 took the front's loop seconds
MAX_REPEAT = 1 << 20  # the longest string or list a template's * makes ("x" * 10 ** 9 is a GB)


MAX_RENDER_WALL_S = 0.5  # the backstop for a loop that takes no call, attribute or item (a plain `for` over a list)


class _Overtime(Exception):
    """Raised inside a render that outlived MAX_RENDER_WALL_S (_Watchdog)."""

    def __str__(self):
        return f"the template ran past {MAX_RENDER_WALL_S * 1e3:.0f} ms"


class _Watchdog:
    """Ends the block it guards with _Overtime after `limit_s`, wherever its thread is in Python code (the
    interpreter's asynchronous exception): a template is the model file's code and may loop forever."""

    def __init__(self, limit_s: float):
        import threading

        self._tid, self._lock, self._on = threading.get_ident(), threading.Lock(), True
        self._fired = False
        self._timer = threading.Timer(limit_s, self._fire)
        self._timer.daemon = True

    def _fire(self):
        with self._lock:
            if self._on:
                self._fired = True
                _async_raise(self._tid, _Overtime)

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        with self._lock:
            self._on = False
            if self._fired:  # raised, or still pending: never let it land outside the render
                _async_raise(self._tid, None)
        return False


def _async_raise(tid: int, exc) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)


def _bounded(base):
    """The sandbox, with its two arithmetic operators that cost what their operands say bounded: ** by its
    exponent, * of a string or list by the length it makes (jinja2 already bounds range()), and a render's
    CPU time: every call, attribute and item a template takes checks it, so nested loops stop within one
    inner loop of MAX_RENDER_CPU_S."""
    from jinja2.exceptions import SecurityError

    class Bounded(base):
        intercepted_binops = frozenset(["**", "*"])
        deadline = float("inf")  # the running render's, in this thread's CPU time (ChatTemplate.render)

        def _in_time(self):
            if time.thread_time() > self.deadline:
                raise SecurityError(f"the template ran past {MAX_RENDER_CPU_S * 1e3:.0f} ms of CPU")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- jinja2's own signature
            __self._in_time()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            self._in_time()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self._in_time()
            return super().getitem(obj, argument)

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_POWER:
                raise SecurityError(f"the template raises to the power {right} (at most {MAX_POWER})")
            if operator == "*":
                seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise SecurityError(f"the template repeats a sequence to {len(seq) * n} items "
                                        f"(at most {MAX_REPEAT})")
            return super().call_binop(context, operator, left, right)

    return Bounded


class ChatTemplate:
    def __init__(self, source: str, bos: str, eos: str, add_bos: bool, add_eos: bool):
        from jinja2 import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = _bounded(ImmutableSandboxedEnvironment)(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise TemplateError(f"the model's chat template does not parse: {e}") from None
        self.bos, self.eos, self.add_bos, self.add_eos = bos, eos, add_bos, add_eos

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError as JinjaError

        today = now()  # llama-server passes both (Llama 3.1's template prints date_string in its system turn)
        context = {"messages": messages, "add_generation_prompt": add_generation_prompt, "bos_token": self.bos,
                   "eos_token": self.eos, "date_string": today.strftime("%d %b %Y"),
                   "datetime": today.strftime("%b %d %Y")}
        if tools:
            context["tools"] = tools
        env = self.template.environment
        env.deadline = time.thread_time() + MAX_RENDER_CPU_S
        try:
            with _Watchdog(MAX_RENDER_WALL_S):
                text = self.template.render(**context)
        except TemplateError:
            raise
        except (JinjaError, TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError,
                RecursionError, MemoryError, _Overtime) as e:  # the model file's code: none of it ends the node
            raise TemplateError(f"the model's chat template failed on these messages: {type(e).__name__}: {e}") \
                from None
        finally:
            env.deadline = float("inf")
        if self.add_bos and self.bos and text.startswith(self.bos):
            text = text[len(self.bos):]
        if self.add_eos and self.eos and text.endswith(self.eos):
            text = text[:-len(self.eos)]
        return text
