"""The continuous-batching scheduler: pure Python, no sockets, no threads, no llama.cpp.

Policy (fixed but for the queue's order):
1. Queued sessions start in the queue's order while a slot, their KV reservation
   and their scratch fit; the head of the queue is never overtaken. The order is
   arrival (`fcfs`), or with the `priority` policy each session's priority
   (vLLM's meaning: lower first), arrival within a priority; within either,
   clients take turns (`_turn`: a session goes behind those whose clients had as
   few queued as its own has), so one client's burst cannot hold everyone's
   place; when the queue is
   full, a request of a better priority than the worst queued one takes its place
   and that one ends REJECTED_QUEUE_FULL, with its `done`. A head that cannot
   start preempts running sessions of a worse priority (core/priority.py says
   which): each goes back to the queue with its tokens and is re-prefilled when
   it starts again, as after an engine restart (vLLM's recompute preemption).
   `reserved_slots` slots are kept for priorities better than 0.
2. Decode first: every running session with exactly one token pending (it is
   generating) gets a row, up to `max_batch_size` sequences; when more wait,
   the ones scheduled longest ago go first, so none starves.
3. Then prefill: sessions with more than one token pending, oldest first (the
   priority policy: in the queue's order), get prompt chunks into the sequence
   slots left, up to `max_prefill_tokens_per_tick` tokens in all (at least 1, so
   a huge prompt still progresses). Prefill never stalls decode, but once under
   the priority policy: a better class's first token that one tick alone gives
   runs without the worse class's decode rows (core/priority.py).
4. A tick of decode rows only, where no prompt is being prefilled, runs them for several steps, each row
   stopping on a token that ends its session (core/steps.py): fewer ticks for the same tokens.
A chunk that reaches the end of a session's tokens samples the next one.

`plan()` then `apply(tick, result)` is one tick. Whoever drives the ticks (front/ticks.py, tests' drivers) may
plan the next ones before the first one's result is back (core/pipeline.py): a session whose sample is still in
flight decodes it as a `follow` chunk the engine fills in. After an engine restart, `engine_restarted()` marks
every running session's KV as gone, and the same chunked prefill rebuilds prompt + generated tokens.

Where a session's KV lives (its sequence id, what it reuses from the prefix cache, what is released when) is
meshnode/core/seqs.py's: a session that starts where cached KV agrees with its tokens prefills only the rest, and
the cache gives way the moment a new session needs an id or cells, so it never changes an admission decision. How
many prompt tokens a tick carries, and in which cuts, is the cost model's (meshnode/core/sizing.py asks it).
"""
from __future__ import annotations

import bisect
import time

from meshnode.core import reasons as R
from meshnode.core import moves
from meshnode.core.admission import Admission, AdmissionDecision
from meshnode.core.budget import NodeBudget
from meshnode.core.costmodel import Shape, TickCost, shape, sized
from meshnode.core.pipeline import Tick
from meshnode.core.schedconfig import SchedulerConfig
from meshnode.core.priority import ahead_of_decoding, displaceable, hurries, victims
from meshnode.core.session import DONE, QUEUED, RUNNING, Ask, Event, Session
from meshnode.core.seqs import Sequences
from meshnode.core.sizing import Sizing
from meshnode.core.steps import plan_steps
from meshnode.core.telemetry import Counters
from meshnode.core.types import Plan, Release, SeqChunk, StepResult

GATHER_SPAN = 4  # an idle engine's first tick waits at most this many quiet gaps (gather_ms) for more requests


class Scheduler:
    def __init__(self, budget: NodeBudget, eos, config: SchedulerConfig, recipe: str | None = None,
                 clock=time.monotonic, pool_cells: int = 0, deterministic: bool = False):
        """`eos`: the end-of-generation token id, or all of them (chat models end turns with
        tokens such as <|eot_id|> besides EOS; llama.cpp calls the set EOG). `config`: the node's
        policy settings (core/schedconfig.py). The rest are the engine's facts: its model's `recipe`,
        `pool_cells` (the KV cells all sequences share in a unified KV, which reserved and cached KV
        must fit together; 0 when each sequence has its own stream) and whether it is `deterministic`
        (chunks cut so that every cell gets the kernel a cold run gives it,
        costmodel.deterministic_chunk, and reuse only of such cells, meshnode/core/prefix.py)."""
        self.budget, self.clock = budget, clock
        self.eog = frozenset([eos] if isinstance(eos, int) else eos)
        self.admission = Admission(budget, recipe, config.reserved_slots)
        self.waiting: list[Session] = []  # in start order (core/priority.py POLICIES)
        self.running: list[Session] = []
        self.live: dict = {}
        self.deterministic, self.pool_cells = deterministic, pool_cells
        self.config = config
        self.seqs = Sequences(budget.n_seq_max, config.prefix_cache, deterministic, pool_cells, config.kv_events)
        self.counters = Counters()
        self.cost, self.tick_target = TickCost(), config.tick_target
        self.sizing = Sizing(self.cost, config.tick_target, budget.max_prefill_tokens_per_tick, deterministic,
                             streams=not pool_cells)
        self.draining = False
        self.engine_down: str | None = None  # why the engine cannot serve (a crash loop): new work is refused
        self.mem_available: int | None = None  # the host's or cgroup's, as last measured
        self.gather_ms, self.steps_ms = config.gather_ms, config.steps_ms
        self.policy, self._arrivals, self._plans, self._hurry = config.policy, 0, 0, False
        self._arrived: tuple[float, float] | None = None  # first and last submit since the last tick was planned

    def calibrated(self, ticks) -> None:
        """The engine's timed start-up ticks (engine/calibration.py, EngineInfo.calibration): the cost model
        estimates from the first request instead of learning on it."""
        for *tick, to_target, ms in ticks:
            self.cost.observe(Shape(*tick), ms, to_target)

    # -- requests --------------------------------------------------------------------
    def submit(self, s: Session) -> AdmissionDecision:
        d = self.precheck(s.ask)
        displaced = ()
        if d.reason == R.QUEUED and len(self.waiting) >= self.budget.max_queue:  # it takes the worst one's place
            worst = displaceable(self.waiting)
            displaced = (self._end(worst, R.REJECTED_QUEUE_FULL, f"the queue is full and a request of priority "
                                   f"{s.priority} took the place of this one (priority {worst.priority})"),)
        if not d.accepted:
            return d
        now = self.clock()
        s.t_submit = s.t_submit or now  # the front stamps arrival, before any tokenizer wait
        self._arrived = (self._arrived[0] if self._arrived else now, now)
        self.live[s.key] = s
        self._arrivals += 1
        level = s.priority if self.policy == "priority" else 0
        s.order = (level, self._turn(s, level), self._arrivals)
        self._hurry |= self.policy == "priority" and hurries(s, self.running, self._alone_cut)
        if d.reason == R.ADMITTED:
            self._start(s)
            return d
        s.state = QUEUED
        at = bisect.bisect(self.waiting, s.order, key=lambda q: q.order)
        self.waiting.insert(at, s)
        return AdmissionDecision(R.QUEUED, f"queued at position {at + 1}", displaced)

    def _turn(self, s: Session, level: int) -> int:
        """Clients take turns in the queue: a session goes behind the queued ones of its level whose clients had
        as few queued when they came, so one client's 256 embedding inputs hold one place ahead of a newcomer,
        not 256 (a request of one client alone keeps arrival order)."""
        return sum(1 for q in self.waiting if q.owner == s.owner and q.order[0] == level)

    def take_hurry(self) -> bool:
        """A request arrived since the last call whose first token a tick in flight delays (priority.hurries)."""
        hurry, self._hurry = self._hurry, False
        return hurry

    def precheck(self, ask: Ask) -> AdmissionDecision:
        """What submit() would decide now, without admitting: for a prompt size that is only a
        lower bound (a text not tokenized yet), a refusal is final and an acceptance provisional."""
        if ask.priority and self.policy != "priority":
            return AdmissionDecision(R.REJECTED_BAD_REQUEST, "priority is served only by a node with "
                                     "--scheduling-policy priority; send none (0) to this one")
        d = self.admission.check(ask, live=ask.key in self.live, queue_len=len(self.waiting), draining=self.draining,
                                 mem_available=self.mem_available, engine_down=self.engine_down)
        worst = displaceable(self.waiting) if d.reason == R.REJECTED_QUEUE_FULL and self.policy == "priority" else None
        if worst is not None and ask.priority < worst.priority:
            return AdmissionDecision(R.QUEUED, "takes the place of the worst queued request")
        return d

    def cancel(self, key) -> Event | None:
        """End a live session now; its reservation frees and its sequence is released next plan."""
        return self.end(key, R.CANCELLED)

    def end(self, key, reason: str) -> Event | None:
        """End a live session for a reason found outside the scheduler (a stop string in its text)."""
        s = self.live.get(key)
        return self._end(s, reason) if s else None

    def export(self, key, path: str) -> list[Event]:
        """Take a live session off this node (core/moves.py): a running one is saved to `path` by the next
        plan and ends EXPORTED when that tick is answered (no events now); a queued one, or one with nothing
        computed, leaves now without KV: its `exported` event, then its `done`."""
        s = self.live[key]
        s.export_to = path
        if s.state == RUNNING and s.n_planned:
            return []
        return [Event("exported", s), self._end(s, R.EXPORTED)]

    def end_all(self, reason: str) -> list[Event]:
        """End every live session (drain deadline, unrecoverable engine): each gets its done."""
        return [self._end(s, reason) for s in list(self.live.values())]

    # -- one tick -----------------------------------------------------------------------
    def gather_until(self) -> float:
        """When (monotonic s) an idle engine's next tick is due; 0 = now. With only new sessions, once they
        stop coming: requests sent together reach the node spread over a few ms (a gateway parses each; a
        router's burst), and a tick started on the first would make every other one wait for it. (With
        ticks in flight the driver plans late in them instead: TickPipeline.plan_ahead_at.)"""
        if not self.gather_ms or not self._arrived or any(s.last_tick >= 0 for s in self.running):
            return 0.0
        first, last = self._arrived
        return min(first + GATHER_SPAN * self.gather_ms / 1e3, last + self.gather_ms / 1e3)

    def plan(self) -> Tick | None:
        """The next tick (numbered when its driver puts it in flight); None when there is nothing to do."""
        self._plans += 1
        self._promote()
        for s in self.running:
            if s.leader:
                self.seqs.follow(s)
        b = self.budget
        decoding = sorted((s for s in self.running if s.pending == 1 and not s.export_to), key=lambda s: s.last_tick)
        prompts = [s for s in self.running if s.pending > 1 and not s.leader and not s.export_to]
        if self.policy == "priority":  # a better session's prompt goes first into the tick's prefill room too
            prompts.sort(key=lambda s: s.order)
            if alone := ahead_of_decoding(prompts, decoding, self._alone_cut):  # a better first token's tick
                decoding, prompts = [], alone
        chunks = [self._chunk(s, 1) for s in decoding[: b.max_batch_size]]
        prompts = prompts[: b.max_batch_size - len(chunks)]
        sizes = self.sizing.prompt_cuts([c for _, c in chunks], [(s.n_planned, s.pending, len(s.prompt))
                                                                  for s in prompts], self._cells())
        for s, n in zip(prompts, sizes):
            chunks.append(self._chunk(s, n))
            self.counters.prefill_tokens += n
        release, kv, reused = self.seqs.take()
        saves, leaving = moves.saves(self.running)
        kv += saves
        if not chunks and not release and not kv and not leaving:
            return None
        if chunks:  # a release-only tick is housekeeping, not a tick of work
            c = self.counters
            c.ticks += 1
            c.occupancy_last = len(chunks)
            c.occupancy_max = max(c.occupancy_max, len(chunks))
            c.occupancy_sum += len(chunks)
        tick = Tick(0, Plan([ch for _, ch in chunks], release, kv), [s for s, _ in chunks], reused, leaving,
                    planned=self._plans)
        self._arrived = None
        tick.plan.steps, tick.plan.ends = plan_steps(chunks, len(self.running), bool(prompts),
                                                     self.cost.measured_decode_ms(len(chunks)), self.steps_ms, self.eog)
        tick.predicted_ms = self.sizing.predicted_ms(tick.plan.chunks, self._cells()) * tick.plan.steps
        return tick

    def _alone_cut(self, s: Session) -> int:
        return self.sizing.prompt_cuts([], [(s.n_planned, s.pending, len(s.prompt))], self._cells())[0]

    def _cells(self) -> int:
        """What each row of a unified pool attends to once the ticks planned so far run (0 on streams)."""
        return self.cells_planned if self.pool_cells else 0

    def _chunk(self, s: Session, n: int) -> tuple[Session, SeqChunk]:
        return s, s.next_chunk(n, self.counters.ticks)

    def apply(self, tick: Tick, result: StepResult) -> list[Event]:
        """Turn the engine's result for `tick` (answered, off the pipeline) into per-session events."""
        events: list[Event] = []
        steps, deferred = tick.plan.steps, set(result.deferred)
        if tick.plan.chunks and result.step_ms > 0 and not deferred:  # a hurried tick's time is not its plan's
            spans = [(c.pos, len(c.tokens)) for c in tick.plan.chunks]
            self.cost.observe(shape(spans, result.kv_cells if self.pool_cells else 0), result.step_ms / result.steps,
                              sized(spans), decode_only=all(n == 1 for _, n in spans), steps=result.steps,
                              drafted=bool(result.drafted or result.served))
        for seq_id in (missed := set(result.cache_miss)):  # a finished session's last tick may have lost its KV
            self.seqs.lost(seq_id)
        for s, c in tick.chunks:
            if not self._current(s, c, tick):  # cancelled, ended or preempted while the tick ran: stale
                if c.seq_id in deferred:  # left undone: its cached entry holds only what was before it
                    self.seqs.undone(c.seq_id, c.pos)
                continue
            if c.seq_id in deferred:  # left undone (Ticks.hurry): its planning undone (next_chunk, plan_steps)
                s.n_planned -= len(c.tokens) + steps - 1
                s.draws_in_flight -= steps * (c.draw >= 0)
                self.counters.prefill_tokens -= len(c.tokens) if len(c.tokens) > 1 or c.draw < 0 else 0
                continue
            if s.progress and c.pos < len(s.prompt) and c.seq_id not in missed:
                events += _progress(s, c)
            if c.draw >= 0:  # a hurried multi-step tick ran result.steps of its steps: the rest are planned again
                s.draws_in_flight, s.n_planned = s.draws_in_flight - steps, s.n_planned - (steps - result.steps)
                if c.seq_id in result.embeddings:  # an embedding session's one result
                    events += [Event("embedding", s, embedding=result.embeddings[c.seq_id]), self._end(s, R.EMBEDDED)]
                    continue
                if (samples := result.samples(c.seq_id)) and samples[-1][0] in tick.plan.ends.get(c.seq_id, ()):
                    s.n_planned = c.pos + len(samples)  # it ends: never fed, by this tick nor one on top (Plan.ends)
                if self._deliver(s, samples, events):
                    continue  # it ended on one of them
            if c.seq_id in missed:
                events.append(self._end(s, R.CACHE_MISS))  # released again: see engine/followups.py
            elif c.seq_id in result.failed:  # its own request can never complete; the tick went on for the rest
                self.counters.constraint_failures += 1
                events.append(self._end(s, R.BAD_REQUEST, result.failed[c.seq_id]))
        for s in tick.reused:  # its Keep or Share found the KV gone (an earlier tick's miss) before any chunk ran
            if self._running_since(s, tick) and s.seq_id in missed:
                events.append(self._end(s, R.CACHE_MISS))
        for s in tick.exports:  # one that ended meanwhile got its own done: its export is answered with that
            events += [moves.exported(s, result.saved), self._end(s, R.EXPORTED)] if s.state == RUNNING else \
                [Event("exported", s, reason=s.reason)]
        return events

    def _deliver(self, s: Session, samples: list, events: list[Event]) -> bool:
        """A tick's samples for the session, in order, as one tokens event, up to the one that ends it (then
        its done too); whether it ended."""
        for i, (tok, _) in enumerate(samples):
            s.tokens.append(tok)
            self.counters.decode_tokens += 1
            if s.n_generated == 1 and not s.t_first:
                s.t_first = self.clock()
            reason = s.finish_reason(tok, self.eog)
            if reason or i == len(samples) - 1:
                lps = [lp for _, lp in samples[:i + 1]]
                events.append(Event("tokens", s, [t for t, _ in samples[:i + 1]],
                                    logprobs=lps if all(lps) else None))
            if reason:
                events.append(self._end(s, reason))
                return True
        return False

    def refused(self, tick: Tick, reason: str = R.ENGINE_ERROR, behind: list[Tick] = ()) -> list[Event]:
        """The engine refused `tick`: end its sessions; the others go on.

        The ticks `behind` it (in flight, planned on top of it) are refused too (TickPipeline.refused), so
        their sessions roll back to before them and are planned again.
        None of the refused releases ran, so they go out again with the next plan (releasing an
        empty sequence is harmless; a lost release would poison its id).
        """
        events = [self._end(s, reason) for s, c in tick.chunks if self._current(s, c, tick)]
        release = []
        for tk in [tick, *behind]:
            for s in tk.exports:  # its save did not run: the next plan saves it
                s.saving = False
            release += tk.plan.release + [op.seq_id for op in tk.plan.kv if isinstance(op, Release)]
            for s, c in tk.chunks if tk is not tick else ():
                if self._current(s, c, tk):
                    s.n_planned = min(s.n_planned, c.pos)
                    s.draws_in_flight -= tk.plan.steps if c.draw >= 0 else 0
            for s in tk.reused:  # its Keep or Share did not run: start it over from position 0
                if self._running_since(s, tk):
                    s.n_planned = s.n_reused = 0
                    release.append(s.seq_id)
        self.seqs.refused(release)
        return events

    def kv_events(self) -> list[list]:
        """The prefix cache's block events since the last call (core/kvevents.py), for the publisher."""
        return self.seqs.cache.blocks.take_events()

    def cached_blocks(self, seen_by=None) -> set[int]:
        """The prefix cache's blocks as its KV events key them, for the status answer (`seen_by`: the
        client asking, who sees only what it could reuse)."""
        return self.seqs.cache.block_hashes(seen_by)

    def save_cache(self, choose) -> list:
        """The next plan saves the cached entries `choose(entries)` picks ((entry, path) pairs, returned):
        the drain's last tick, for kv_persist (front/persist.py)."""
        saving = choose(self.seqs.cache.entries.values())
        self.seqs.save_entries(saving)
        return saving

    def restore_cache(self, kept: list) -> int:
        """Entries read back at start (front/persist.py) into the prefix cache; how many fit."""
        n = self.seqs.restore(kept)
        self.seqs.fit(0)
        return n

    def engine_restarted(self) -> None:
        """The engine's KV is gone (its driver dropped the ticks in flight): rebuild every running session by
        re-prefilling it."""
        self.seqs.restarted()
        for s in self.running:
            s.forget_kv()
            s.saving = False  # a session asked to leave goes without KV

    # -- internals ----------------------------------------------------------------------
    def _start(self, s: Session) -> None:
        self.admission.reserve(s.ask)
        self.seqs.place(s, self.running)
        s.state, s.t_start = RUNNING, s.t_start or self.clock()  # a preempted session's queue time is its first wait
        self.running.append(s)
        self.seqs.fit(self.admission.kv_reserved_bytes // self.budget.kv_bytes_per_token)

    def _promote(self) -> None:
        while self.waiting and (self._fits(self.waiting[0]) or self._preempt_for(self.waiting[0])):
            self._start(self.waiting.pop(0))

    def _fits(self, s: Session) -> bool:
        return self.admission.can_start(s.ask) and self.seqs.available

    def _preempt_for(self, head: Session) -> bool:
        """Under the priority policy, make room for `head` by preempting running sessions (core/priority.py)."""
        running = [s for s in self.running if not s.export_to]  # one leaving is about to free its room
        out = victims(head, running, self.admission.can_start) if self.policy == "priority" else []
        for s in out:
            self._preempt(s)
        return bool(out) and self._fits(head)

    def _preempt(self, s: Session) -> None:
        """Back to the queue with what it has; results of its ticks still in flight are stale (`_current`)."""
        self.admission.release(s.ask)
        self.running.remove(s)
        self.seqs.finished(s, keep=True)
        s.state, s.seq_id, s.leader, s.stale_before = QUEUED, -1, None, self._plans
        s.forget_kv()
        bisect.insort(self.waiting, s, key=lambda q: q.order)
        self.counters.preemptions += 1

    def _current(self, s: Session, c: SeqChunk, tick: Tick) -> bool:
        """The chunk's session is still running on that sequence, and was when the tick was planned."""
        return self._running_since(s, tick) and s.seq_id == c.seq_id

    @staticmethod
    def _running_since(s: Session, tick: Tick) -> bool:
        """Running, and in the same incarnation as when `tick` was planned (not preempted since)."""
        return s.state == RUNNING and tick.planned >= s.stale_before

    def _end(self, s: Session, reason: str, detail: str = "") -> Event:
        if s.state == RUNNING:
            self.admission.release(s.ask)
            self.running.remove(s)
            self.seqs.finished(s, keep=reason not in R.KV_UNTRUSTED)
        elif s.state == QUEUED:
            self.waiting.remove(s)
        s.state, s.reason, s.t_done = DONE, reason, s.t_done or self.clock()  # the output stage may have stamped it
        self.live.pop(s.key, None)
        return Event("done", s, s.generated, reason, detail)

    @property
    def cells_planned(self) -> int:
        """KV cells held once every tick planned so far has run (live and cached): what a unified pool's rows see."""
        return self.live_cells + self.seqs.cells

    @property
    def live_cells(self) -> int:
        """KV cells the running sessions hold once every tick planned so far has run."""
        return sum(s.n_planned for s in self.running)

    @property
    def idle(self) -> bool:
        return not self.live and not self.seqs.to_release and not self.seqs.kv_ops


def _progress(s: Session, c) -> list[Event]:
    """A prompt chunk computed, as `progress` events (llama-server's prompt_progress): with its first chunk also
    where the prompt started, what its reused KV covered."""
    total, done = len(s.prompt), min(c.pos + len(c.tokens), len(s.prompt))
    start = [Event("progress", s, progress=(total, s.n_reused, s.n_reused))] if c.pos == s.n_reused else []
    return [*start, Event("progress", s, progress=(total, s.n_reused, done))]

