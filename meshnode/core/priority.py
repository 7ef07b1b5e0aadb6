"""The priority policy's choices, apart from the scheduler that carries them out.

Who gives way to a better request is a question of order alone: a queued session that has not started
yet may be displaced from a full queue, and running sessions of a worse priority may be preempted, the
worst first (vLLM's rule), and only as many as make room: preempting some and still not fitting would
recompute their KV for nothing.
"""
from __future__ import annotations

from typing import Callable

from meshnode.core.session import Ask, Session

POLICIES = ("fcfs", "priority")


def policy_problem(policy: str, reserved_slots: int, active: int) -> str:
    """The queue policy's rule ("" when it holds): slots kept for better priorities need the priority policy
    and must leave the default class at least one of the `active` slots."""
    if policy not in POLICIES:
        return f"scheduling_policy: must be one of {', '.join(POLICIES)}, got {policy!r}"
    if reserved_slots and (policy != "priority" or reserved_slots >= active):
        return (f"priority_reserved_slots: {reserved_slots} needs scheduling_policy = priority and fewer than the "
                f"{active} sessions that may run at once (max_active)")
    return ""


def displaceable(waiting: list[Session]) -> Session | None:
    """The worst queued session that has not started yet: a preempted one has streamed tokens, and is never
    refused after that."""
    return next((s for s in reversed(waiting) if not s.stale_before), None)


def victims(head: Session, running: list[Session], fits: Callable[[Ask, list[Ask]], bool]) -> list[Session]:
    """The running sessions `head` preempts to start: of a worse priority, worst first, the fewest with which
    `fits(head's ask, theirs)`; none when even all of them would not make room."""
    worse = sorted((s for s in running if s.priority > head.priority), key=lambda s: s.order, reverse=True)
    for n in range(1, len(worse) + 1):
        if fits(head.ask, [s.ask for s in worse[:n]]):
            return worse[:n]
    return []


def ahead_of_decoding(prompts: list[Session], decoding: list[Session], cut: Callable[[Session], int]) -> list[Session]:
    """The prompts that take a tick alone, without the decode rows: those of a better priority than every decoding
    session, before their first token, whose rest `cut` (the tokens a tick alone would give it) finishes.
    A first token of a better class then waits for its own prefill alone, not for a tick of the worse class's
    decode rows beside it (on streams each is a llama_decode call of its own); the worse class's streams pay
    one gap of that prefill. A longer prompt goes the usual way: starving the streams for it would stall them
    for as long as it takes."""
    if not decoding:
        return []
    best_decoding = min(s.priority for s in decoding)
    return [s for s in prompts if s.priority < best_decoding and s.n_generated == 0 and cut(s) >= s.pending]


def hurries(new: Session, running: list[Session], cut: Callable[[Session], int]) -> bool:
    """A request just arrived whose first token the ticks in flight would delay: it will take a tick alone
    (ahead_of_decoding: better than every decoding session, its prompt one tick's), and what they carry is the
    worse class's. They may leave it undone (Ticks.hurry): it is planned again behind the better request."""
    return bool(ahead_of_decoding([new], [s for s in running if s.pending == 1], cut))
