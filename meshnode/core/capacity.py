"""What a router asks before it sends work: how much room there is, and how soon a prompt would start.

The first-token estimate replays the scheduler's own rules forward with the tick cost
model: the prompts ahead of the new one (running sessions' remaining prefill, then the
queue, in order) take the prefill room each tick gets beside the decoders, and the new
prompt's first token comes with the tick that computes its last chunk. A new session
that must wait for a slot first waits for the running session closest to its end. It
is an estimate from measured tick costs, not a promise, and there is none (None) until
the cost model has seen enough ticks.
"""
from __future__ import annotations

from meshnode.core.costmodel import shape
from meshnode.core.session import Ask

MAX_TICKS = 10_000  # the replay's bound: beyond it the estimate is unknown


def capacity(sched, prompt_tokens: int = 0) -> dict:
    b, a, cost = sched.budget, sched.admission, sched.cost
    decoding = [s for s in sched.running if s.pending == 1]
    free_slots = max(0, b.effective_active_cap - len(sched.running))
    out = {"free_slots": free_slots,
           "free_kv_tokens": max(0, (b.kv_budget_bytes - a.kv_reserved_bytes) // b.kv_bytes_per_token),
           "max_session_tokens": b.n_ctx_seq,
           "queue_room": max(0, b.max_queue - len(sched.waiting)),
           "decoding": len(decoding), "tick_target_ms": sched.tick_target.ms or None,
           "tick_target_ratio": sched.tick_target.ratio if not sched.tick_target.ms else None,
           "decode_tokens_per_s": None, "ttft_ms_estimate": None, "tick_model": cost.describe()}
    never = a.never_fits(Ask(None, prompt_tokens, 1)) if prompt_tokens > 0 else None
    if never:  # no estimate for a prompt that would be refused: say so instead
        out["refused"] = {"reason": never.reason, "detail": never.detail}
        return out
    if not cost.ready:
        return out
    unified = 0
    if sched.pool_cells:  # the cells every row attends to: the cache gives way to what the prompt and the queue reserve
        reserved = (a.kv_reserved_bytes + sum(a.kv_need(s.ask) for s in sched.waiting)) // b.kv_bytes_per_token
        unified = sched.live_cells + sched.seqs.cached_beside(reserved + prompt_tokens + 1)
    decode_only = shape([(s.n_planned, 1) for s in decoding], unified)
    decode_ms = cost.decode_tick_ms(decode_only) if decoding else 0.0
    out["decode_tokens_per_s"] = round(len(decoding) * 1e3 / decode_ms, 1) if decoding else 0.0
    if decoding and sched.tick_target and not sched.tick_target.ms:  # what the ratio comes to now
        out["tick_target_ms"] = round(sched.tick_target.bound_ms(cost, decode_only), 1)
    if prompt_tokens > 0:
        wait_ms = 0.0
        if free_slots <= len(sched.waiting):  # no slot for it: the running session closest to its end frees one
            wait_ms = min((s.max_tokens - s.n_generated for s in sched.running), default=0) * decode_ms
        prompts = [(s.n_planned, s.pending, len(s.prompt)) for s in sched.running if s.pending > 1]
        prompts += [(0, len(s.prompt), len(s.prompt)) for s in sched.waiting] + [(0, prompt_tokens, prompt_tokens)]
        decoders = [(s.n_planned, s.max_tokens - s.n_generated) for s in decoding]
        out["ttft_ms_estimate"] = _replay(sched, prompts, decoders, unified, wait_ms)
    return out


def _replay(sched, prompts: list[tuple[int, int, int]], decoders: list[tuple[int, int]], unified: int,
            t: float) -> float | None:
    """Ticks until the last of `prompts` ((position, tokens left, prompt length)) is computed, in ms from `t`, with
    `decoders` ((position, tokens left)) ending as they run out and, on a unified KV, the pool's
    `unified` cells growing with every token computed and shrinking as sessions end."""
    cost, prompts = sched.cost, list(prompts)
    for k in range(MAX_TICKS):
        live = [(pos + k, 1) for pos, left in decoders if left > k]
        if unified:
            unified += len(live) - sum(pos + k for pos, left in decoders if left == k)
        chunks = []
        for n in sched.sizing.cuts(sched.sizing.room(live, unified, prompts[0][0]), prompts, bool(live)):  # as plan()
            pos, left, n_prompt = prompts[0]
            chunks.append((pos, n))
            prompts[0] = (pos + n, left - n, n_prompt)
            if n == left:
                prompts.pop(0)
        if unified:
            unified += sum(n for _, n in chunks)
        t += cost.predict(shape(live + chunks, unified), bool(live and chunks))
        if not prompts:
            return round(t, 1)
    return None
