"""How many decode steps a tick runs (Plan.steps): one plan, one answer and one client message for several tokens.

A tick costs the node more than its llama_decode: the front plans it and applies its answer, the link carries
it both ways, each client hears of it. On a small CPU that work runs beside the next decode and slows it
(a lone session on 2 cores: 6.0 ms a token in process, 7.5-8 through the node: evidence/README.md, "One
user"). Where the next tick's plan could not differ (every running session decoding, no prompt to prefill,
nobody queued who could start: the plan starts whoever fits first), a tick runs its decode rows several
times in a row instead (vLLM's multi-step scheduling):
as many as fit `budget_ms` (or miss it by less than STEPS_SLACK) by what decode ticks of these rows took lately,
never past a session's last token,
and each row stops on a token that ends its session (Plan.ends: its end of generation, a stop token), so an
answer that ends early is not held back by steps computed for nothing.
What it costs: a request that arrives meanwhile, or waits for a slot that a session ending on its end token
frees, waits at most `budget_ms` (and the slack) longer to start (a session's last token by length ends the tick: a queued
request starts at once), a cancel as long to take effect, and tokens reach a client a few at a time.
"""
from __future__ import annotations

MAX_STEPS = 16  # the most steps one tick runs, however fast a step (engine/base.py accepts up to 64)
# how far past budget_ms the steps may go: a count whose steps miss the budget by less than this still runs. A
# budget exactly a whole number of steps is common (8 rows of SmolLM2 q8_0 on 2 cores take 23-27 ms a step
# against the default 50): there a node fell to one step a tick on its own timing noise, and the front's work
# of each extra tick, beside the decode on cores llama.cpp holds, slowed its steps and kept it there (the
# pipelined node ran 35-66 ticks where the engine in process ran 35-58 for the same tokens:
# evidence/overhead-bench-smollm2-kept-c8.json)
STEPS_SLACK = 0.1


def decode_steps(decode_ms: float | None, left: int, budget_ms: float) -> int:
    """Steps for a decode-only tick whose rows' ticks took `decode_ms` lately (None: not known yet), where
    the session nearest its end may sample `left` more tokens."""
    if not decode_ms or left <= 1:
        return 1
    return min(left, _fitting(decode_ms, budget_ms * (1 + STEPS_SLACK)))


def budget_cadence(decode_ms: float, budget_ms: float) -> float:
    """How far apart a decode-only tick of steps of `decode_ms` delivers tokens with the steps the budget fits,
    not the slack's: what a burst's tick target counts (core/sizing.py, TickTarget)."""
    return decode_ms * _fitting(decode_ms, budget_ms)


def _fitting(decode_ms: float, budget_ms: float) -> int:
    """Steps of `decode_ms` (> 0) that fit `budget_ms`: at least one, at most MAX_STEPS; one without a budget."""
    return max(1, min(MAX_STEPS, int(budget_ms // decode_ms))) if budget_ms > 0 else 1


def plan_steps(chunks: list, running: int, prefilling: bool, decode_ms: float | None, budget_ms: float,
               eog: frozenset) -> tuple[int, dict]:
    """Steps for a tick of (session, chunk) pairs: more than one only where every one of the `running`
    sessions decodes in it, none is `prefilling` (its prompt), and no session's text is
    watched for stop strings (the front finds those, a token at a time); with the tokens that end each row
    (Plan.ends; `eog`: the model's). The sessions' planned positions and draws in flight move with the steps."""
    if (not chunks or prefilling or len(chunks) < running or budget_ms <= 0
            or any(c.draw < 0 or len(c.tokens) != 1 or s.stop_text or c.embed for s, c in chunks)):
        return 1, {}
    n = decode_steps(decode_ms, 1 + min(s.max_tokens - s.n_generated - s.draws_in_flight for s, _ in chunks),
                     budget_ms)
    for s, _ in chunks:
        s.n_planned += n - 1
        s.draws_in_flight += n - 1
    return n, {c.seq_id: ends for s, c in chunks if (ends := s.end_tokens(eog))} if n > 1 else {}
