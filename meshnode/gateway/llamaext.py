"""llama-server's own fields on the OpenAI surface, which its clients read: `timings`, `prompt_progress`,
`__verbose`, the context-size error body. OpenAI's clients ignore them; someone moving from llama-server keeps
the tools that read them (its web UI, llama.cpp's own server tests).

A request asks them as llama-server's do: `timings_per_token` (timings in every streamed chunk, not only the
last), `return_progress` (a chunk per computed prompt chunk), `verbose` (the rendered prompt beside the answer).
Every figure comes from the node's own events: a `done`'s usage (prompt_tokens, cached_tokens, queue_ms,
ttft_ms, total_ms) and, while streaming, its `progress` events and the tokens as they come.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Asked:
    progress: bool = False  # return_progress
    per_token: bool = False  # timings_per_token
    verbose: bool = False

    @staticmethod
    def of(body: dict) -> Asked:
        return Asked(*(body.get(k) is True for k in ("return_progress", "timings_per_token", "verbose")))

    @property
    def node_progress(self) -> bool:
        """The node's `progress` events are needed: forwarded, or the prompt's figures for per-token timings."""
        return self.progress or self.per_token


def timings(cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict:
    """llama-server's `timings` object (server-task.cpp, result_timings::to_json)."""
    def per(n, ms):
        return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)

    p_tok, p_sec = per(prompt_n, prompt_ms)
    g_tok, g_sec = per(predicted_n, predicted_ms)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": p_tok, "prompt_per_second": p_sec, "predicted_n": predicted_n,
            "predicted_ms": round(predicted_ms, 3), "predicted_per_token_ms": g_tok, "predicted_per_second": g_sec}


def final_timings(done: dict) -> dict:
    """A finished session's timings, from its `done`'s usage: the prompt from the node's start on it to its
    first token (the queue left out), the generation from there to the end."""
    u = done.get("usage") or {}
    cached = u.get("cached_tokens", 0)
    ttft, queue, total = u.get("ttft_ms", 0.0), u.get("queue_ms", 0.0), u.get("total_ms", 0.0)
    return timings(cached, max(0, u.get("prompt_tokens", 0) - cached), max(0.0, ttft - queue),
                   u.get("completion_tokens", 0), max(0.0, total - ttft))


def context_error(ev: dict) -> dict:
    """llama-server's `exceed_context_size_error` fields, from a REJECTED_CONTEXT_TOO_LONG that carries them."""
    return {k: ev[k] for k in ("n_prompt_tokens", "n_ctx") if k in ev}


@dataclass
class Running:
    """One streamed answer's figures so far, for `timings_per_token` and `prompt_progress`."""

    asked: Asked
    clock: object = time.monotonic
    prompt: tuple = (0, 0, 0.0)  # (prompt tokens computed, reused, ms from arrival) as the last progress said
    first_token: float | None = None
    tokens: int = 0

    def progress(self, ev: dict) -> dict | None:
        """A node `progress` event -> the `prompt_progress` object to send (None where not asked)."""
        self.prompt = (ev["processed"] - ev["cache"], ev["cache"], ev["time_ms"])
        if not self.asked.progress:
            return None
        return {"total": ev["total"], "cache": ev["cache"], "processed": ev["processed"],
                "time_ms": ev["time_ms"]}

    def token(self, n: int) -> dict | None:
        """`n` tokens arrived -> the timings to send with their chunk (None where not asked per token)."""
        now = self.clock()
        if self.first_token is None:
            self.first_token = now
        self.tokens += n
        if not self.asked.per_token:
            return None
        computed, cached, ms = self.prompt
        return timings(cached, computed, ms, self.tokens, (now - self.first_token) * 1e3)
