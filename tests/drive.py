"""A minimal engine driver for tests: prefill in chunks, then decode, per plan rules."""
import numpy as np

from meshnode.core.types import GREEDY, Plan, SeqChunk


def generate(engine, prompts: dict, n_new: int, chunk: int | None = None, sampling=None, together=True,
             logits_out: dict | None = None):
    """Greedy/seeded generation of `n_new` tokens for {seq_id: prompt}; returns {seq_id: tokens}.

    together=True puts every sequence in the same ticks (one llama_decode each);
    False runs them one after another, each alone. `chunk` splits prompts.
    """
    if not together:
        out = {}
        for sid, p in prompts.items():
            out.update(generate(engine, {sid: p}, n_new, chunk, sampling, True, logits_out))
        return out
    sampling = sampling or {}
    state = {sid: {"toks": list(p), "cached": 0, "gen": []} for sid, p in prompts.items()}
    engine.step(Plan([], list(prompts)))  # start clean
    while any(len(s["gen"]) < n_new for s in state.values()):
        chunks = []
        for sid, s in state.items():
            if len(s["gen"]) >= n_new:
                continue
            pending = len(s["toks"]) - s["cached"]
            n = pending if chunk is None else min(pending, chunk)
            end = s["cached"] + n == len(s["toks"])
            chunks.append(SeqChunk(sid, s["cached"], np.array(s["toks"][s["cached"]:s["cached"] + n], np.int32),
                                   draw=len(s["gen"]) if end else -1,
                                   sampling=sampling.get(sid, GREEDY) if s["cached"] == 0 else None))
        plan = Plan(chunks)
        if logits_out is not None:
            got = engine.logits_for(plan)
            res = {sid: int(np.argmax(row)) for sid, row in got.items()}
            for sid, row in got.items():
                logits_out.setdefault(sid, []).append(row)
        else:
            res = engine.step(plan).tokens
        for c in chunks:
            s = state[c.seq_id]
            s["cached"] = c.pos + len(c.tokens)
            if c.draw >= 0:
                s["toks"].append(res[c.seq_id])
                s["gen"].append(res[c.seq_id])
    return {sid: s["gen"] for sid, s in state.items()}


class Pipelined:
    """The node's tick pipeline in one process: the front's side (plan up to `depth` ticks ahead,
    resync after a refusal) and the engine process's side (a Chain in front of the engine).

    `refuse` holds tick numbers the engine refuses as bad plans, `miss` tick numbers whose
    llama_decode finds no KV slot (every sequence of the tick is lost, as with rc=1).
    """

    def __init__(self, sched, engine, depth=2, refuse=(), miss=()):
        from meshnode.engine.chain import Chain

        self.sched, self.engine, self.depth, self.chain = sched, engine, depth, Chain()
        self.refuse, self.miss = set(refuse), set(miss)
        self.queue, self.t, self.resync, self.follows = [], 0, False, 0
        self.refused: list = []  # plans refused for themselves, not for awaiting a resync

    def fill(self):
        while len(self.queue) < self.depth:
            plan = self.sched.plan()
            if plan is None:
                return
            self.t += 1
            self.follows += sum(c.follow for c in plan.chunks)
            self.queue.append([self.t, plan, self.resync, False])
            self.resync = False

    def run_one(self):
        """The engine runs the oldest queued tick; the front handles its reply."""
        from meshnode.engine.chain import AWAITING_RESYNC
        from meshnode.core.types import InvalidPlan

        t, plan, resync, discard = self.queue.pop(0)
        try:
            if t in self.refuse:
                self.chain.resolve(plan, resync)  # a refusal while awaiting resync stays one
                raise InvalidPlan(f"tick {t} refused on purpose")
            res = self.chain.step(_NoSlot(self.engine) if t in self.miss else self.engine, plan, resync)
        except InvalidPlan as e:
            # only the refusals a test asked for, and the ones queued behind them, are expected
            if not (t in self.refuse or (discard and str(e) == AWAITING_RESYNC)):
                raise
            self.chain.failed()
            if discard:
                return []
            self.refused.append(plan)
            for q in self.queue:
                q[3] = True
            self.resync = True
            return self.sched.fail_inflight("ENGINE_ERROR")
        return [] if discard else self.sched.apply(res)

    def run_to_completion(self, max_ticks=10_000):
        events = []
        for _ in range(max_ticks):
            self.fill()
            if not self.queue:
                return events
            events += self.run_one()
        raise RuntimeError("pipeline did not drain")


class _NoSlot:
    """llama_decode rc=1: no KV slot for the tick; the engine drops every sequence in it."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, plan):
        from meshnode.core.types import StepResult

        seqs = [c.seq_id for c in plan.chunks]
        self.engine.step(Plan([], list(plan.release) + seqs))
        return StepResult(cache_miss=seqs)
