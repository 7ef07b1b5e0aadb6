"""What the tests share: prompts, a clock, one way to build a scheduler, engine drivers, node helpers."""
import os
import random
from dataclasses import replace
import subprocess
import sys
import time

import numpy as np
import psutil

from ipc.shm import leftover_segments
from meshnode.core.budget import NodeBudget
from meshnode.core.pipeline import TickPipeline
from meshnode.core.schedconfig import SchedulerConfig
from meshnode.core.scheduler import Scheduler
from meshnode.core.session import Session
from meshnode.core.types import GREEDY, InvalidPlan, Plan, Release, SeqChunk, StepResult
from meshnode.dev.clients import deaf_client  # noqa: F401  (re-exported for the tests)
from meshnode.dev.drive import run_tick, run_to_completion  # noqa: F401
from meshnode.dev.fake import FakeEngine
from meshnode.engine.followups import AWAITING_RESYNC, Followups
from meshnode.front.ticks import check_answer
from meshnode.ops.config import scheduler_config


def prompt(n, salt=0):
    """A deterministic prompt of n token ids, none of them a control token."""
    return [3 + (i * 29 + salt * 7) % 500 for i in range(n)]


def session(key, n_prompt=4, max_tokens=5, salt=0, **kw):
    return Session(key, prompt(n_prompt, salt), max_tokens, **kw)


class Clock:
    """An injectable monotonic clock the test moves by hand."""

    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


NODE_POLICY = scheduler_config()  # what `meshnode serve` runs by default


def scheduler(engine=None, clock=None, pool_cells=0, deterministic=False, **kw):
    """(engine, scheduler) over a fake engine unless one is given, running the node's default policy:
    `kw` names the SchedulerConfig fields the test changes, the rest of it NodeBudget fields."""
    e = engine or FakeEngine(n_seq_max=8, n_ctx=4096)
    policy = replace(NODE_POLICY, **{k: kw.pop(k) for k in list(kw) if k in SchedulerConfig.__dataclass_fields__})
    s = Scheduler(NodeBudget.from_engine(e, **kw), e.eog, policy, recipe=e.recipe_fingerprint,
                  pool_cells=pool_cells, deterministic=deterministic, **({"clock": clock} if clock else {}))
    return e, s


def step(sched, engine, tick):
    """Run one planned tick on the engine and apply its answer (lockstep)."""
    return sched.apply(tick, engine.step(tick.plan))


def done_reasons(events):
    return {e.session.key: e.reason for e in events if e.kind == "done"}


def outputs(events):
    return {e.session.key: e.tokens for e in events if e.kind == "done"}


# -- engines, driven directly ------------------------------------------------------------------------
def generate(engine, prompts: dict, n_new: int, chunk: int | None = None, sampling=None, together=True,
             logits_out: dict | None = None):
    """Greedy/seeded generation of `n_new` tokens for {seq_id: prompt}; returns {seq_id: tokens}.

    together=True puts every sequence in the same ticks (one llama_decode each); False runs them one
    after another, each alone. `chunk` splits prompts.
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
    """The node's tick pipeline in one process: the scheduler planning up to its pipeline's depth ahead
    (the front's side) and Followups in front of the engine (the engine process's side).

    `refuse` holds tick numbers the engine refuses as bad plans, `miss` tick numbers whose
    llama_decode finds no KV slot (every sequence of the tick is lost, as with rc=1).
    """

    def __init__(self, sched, engine, refuse=(), miss=(), depth=2):
        self.sched, self.engine, self.followups = sched, engine, Followups()
        self.pipeline = TickPipeline(depth)  # the front's tick driver's (front/ticks.py), without the process
        self.refuse, self.miss = set(refuse), set(miss)
        self.sent: list = []  # ticks sent to the engine, not run yet
        self.follows = 0
        self.refused: list = []  # plans refused for themselves, not for awaiting a resync

    def fill(self):
        while not self.pipeline.full and (tick := self.sched.plan()) is not None:
            self.pipeline.push(tick)
            self.follows += sum(c.follow for c in tick.plan.chunks)
            self.sent.append(tick)

    def run_one(self):
        """The engine runs the oldest tick sent; the front handles its answer."""
        tick = self.sent.pop(0)
        try:
            if tick.t in self.refuse:
                self.followups.resolve(tick.plan, tick.resync)  # a refusal while awaiting resync stays one
                raise InvalidPlan(f"tick {tick.t} refused on purpose")
            engine = _NoSlot(self.engine) if tick.t in self.miss else self.engine
            res = self.followups.run(engine, tick.plan, tick.resync)
        except InvalidPlan as e:
            # only the refusals a test asked for, and the ones queued behind them, are expected
            if not (tick.t in self.refuse or (tick.discard and str(e) == AWAITING_RESYNC)):
                raise
            self.followups.refused()
            answered = self.pipeline.answer(tick.t)
            if answered is None:
                return []
            self.refused.append(tick.plan)
            return self.sched.refused(answered, "ENGINE_ERROR", self.pipeline.refused())
        answered = self.pipeline.answer(tick.t)
        if answered is not None:  # what the front checks of every answer
            check_answer(res, answered.plan, self.engine.n_vocab)
        return [] if answered is None else self.sched.apply(answered, res)

    def run_to_completion(self, max_ticks=10_000):
        events = []
        for _ in range(max_ticks):
            self.fill()
            if not self.sent:
                return events
            events += self.run_one()
        raise RuntimeError("pipeline did not drain")


class _NoSlot:
    """llama_decode rc=1: no KV slot for the tick; the engine drops every sequence in it."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, plan):
        seqs = [c.seq_id for c in plan.chunks]  # the releases and KV operations ran before the decode failed
        self.engine.step(Plan([], list(plan.release), list(plan.kv) + [Release(s) for s in seqs]))
        return StepResult(cache_miss=seqs)


# -- what the default mode promises ---------------------------------------------------------------
def promised(model_path: str) -> bool:
    """Whether docs/determinism.md promises deterministic mode for this model on this CPU: where it does, a
    node or engine without the mode is a failure, never a skip (engine/invariant.py, `promised`)."""
    from meshnode.engine import invariant, llamacpp

    return invariant.promised(llamacpp.matmul_weight_types(model_path), llamacpp.system_info())


def engine_config(model: str, **settings):
    """An engine as the node builds one (NodeConfig's names and checks: meshnode/ops/config.py), with what the
    engine tests were written for unless a test says otherwise: one unified KV pool of 4096 cells, not
    deterministic."""
    from meshnode.ops import config

    return config.engine_config(model, **{"kv_layout": "unified", "deterministic": False, "ctx": 4096, **settings})


def deterministic_node(c, model_path: str) -> bool:
    """Whether the node behind client `c` runs deterministic mode; asserted on where it is promised, unless the
    default left it off because it would cost a session decoding alone (engine/invariant.py, lone_cost)."""
    node = c.status()["node"]
    why = node["deterministic_problem"]
    if promised(model_path) and not why.startswith("deterministic: off by default:"):
        assert node["deterministic"], f"deterministic mode is promised here; the node: {why}"
    return node["deterministic"]


def assert_as_promised(got, want, deterministic: bool, prefix=False):
    """`got` against the reference run `want`: in deterministic mode bitwise (tokens, and logprobs where both
    asked), a prefix where `prefix` (ended early); without it, the default mode's promise (the same up to a
    numerical tie, assert_same_or_a_tie)."""
    if not deterministic:
        return assert_same_or_a_tie(got, want, prefix=prefix)
    n = len(got.tokens)
    assert n == len(want.tokens) or (prefix and n <= len(want.tokens)), (n, len(want.tokens))
    assert got.tokens == want.tokens[:n], "deterministic mode: tokens differ from the reference run"
    mine, theirs = logprob_entries(got), logprob_entries(want)
    if mine and theirs:
        assert mine == theirs[:len(mine)], "deterministic mode: logprobs differ from the reference run"
    return None


TIE = 1e-3  # logprob gap under which two tokens are a numerical tie (batch-dependent numerics: ~1e-5 in f32)


def logprob_entries(r) -> list[dict]:
    """One `{token, logprob, top}` map per generated token of a Result submitted with logprobs."""
    return [x for e in r.events for x in e.get("logprobs", [])]


def assert_consistent(r, n_tokens=None, reason=None):
    """Exactly what a session's own stream promises: done carries the streamed tokens, and the text
    is the concatenation of the streamed pieces."""
    assert r.done is not None, r.admission
    assert r.done["tokens"] == r.tokens and "".join(e["text"] for e in r.events) == r.done["text"]
    if n_tokens is not None:
        assert len(r.tokens) == n_tokens, (len(r.tokens), r.done)
    if reason is not None:
        assert r.done["reason"] == reason, r.done


def assert_same_or_a_tie(got, want, tol=TIE, prefix=False) -> int | None:
    """The default mode's promise for a greedy session whose batches differ from the reference run's
    (an engine restart's re-prefill, a prefix-cache hit, other neighbours): llama.cpp's numbers depend
    on the batch in the last bits, so the tokens are the same up to a point where the reference's two
    best tokens were within `tol` of each other, and may take the other branch from there. Both runs
    must have asked for logprobs >= 2; with `prefix`, `got` may have ended early. Returns where they
    part, or None."""
    assert len(got.tokens) == len(want.tokens) or (prefix and len(got.tokens) <= len(want.tokens)), \
        (len(got.tokens), len(want.tokens))
    entries = logprob_entries(want)
    assert len(entries) == len(want.tokens), "the reference run must ask for logprobs"
    for i, (a, b) in enumerate(zip(got.tokens, want.tokens)):
        if a != b:
            top = {t["token"]: t["logprob"] for t in entries[i]["top"]}
            assert a in top and top[b] - top[a] <= tol, \
                f"token {i}: {a} instead of {b}, where the reference's logprobs were {entries[i]['top']}: no tie"
            return i
    return None


# -- nodes ----------------------------------------------------------------------------------------
def children_of(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def run_jobs(c, jobs: dict) -> dict:
    """Submit every job ({id: submit kwargs}) through client `c` and collect them all."""
    for sid, kw in jobs.items():
        c.submit(sid, **kw)
    return c.collect(list(jobs))


def router_metrics(text: str) -> dict:
    """The model-server protocol's metrics as a router reads them (the Gateway API Inference Extension and
    llm-d parse the Prometheus text format): name -> (type, [(labels, value)])."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: (f.type, [(s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def assert_routable(text: str, model: str, running: int | None = None, waiting: int | None = None) -> dict:
    """What the inference extension requires (waiting, KV usage) and llm-d reads (running, cache config), with
    vLLM's types and labels (and the values, where given); returns the cache config's labels."""
    m = router_metrics(text)
    for name, want in (("vllm:num_requests_running", running), ("vllm:num_requests_waiting", waiting)):
        kind, [(labels, value)] = m[name]
        assert kind == "gauge" and labels == {"model_name": model} and value == (value if want is None else want), \
            (name, m[name])
    kind, [(labels, usage)] = m["vllm:kv_cache_usage_perc"]
    assert kind == "gauge" and labels == {"model_name": model} and 0.0 <= usage <= 1.0
    kind, [(info, one)] = m["vllm:cache_config_info"]
    assert kind == "gauge" and one == 1.0 and int(info["block_size"]) > 0 and int(info["num_gpu_blocks"]) > 0
    return info


def wait_until(pred, timeout_s=10.0, every_s=0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    return pred()


def assert_clean(node, before_segments):
    """After a node stops: exit 0, no child left, no new shm segment, no socket file."""
    assert node.proc.returncode == 0, node.log()
    new = set(leftover_segments(node.proc.pid)) - set(before_segments)  # this node's: others may run beside
    assert not new, f"shared memory left behind: {new}"
    left = [f for f in os.listdir(node.run_dir) if f.endswith(".sock") or f.endswith(".lock")]
    assert not left, f"files left in the run dir: {left}"


def curve_keys(tmp_path, *names):
    """A server certificate and client certificates in zmq.auth format; the clients' public keys are allowed.
    Returns (allow dir, server public file, server secret file, {name: secret file})."""
    import zmq.auth

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    secrets = {}
    for name in names:
        public, secrets[name] = zmq.auth.create_certificates(str(keys), name)
        if not name.startswith("stranger"):
            os.rename(public, allowed / f"{name}.key")
    return allowed, server_public, server_secret, secrets


def serve(model, *args, internal=None, timeout=60, env=None):
    """Run `meshnode serve` to its end (a node that must refuse to start); internal settings go
    through the test entry, as NodeProcess does."""
    import json

    entry = ["meshnode.dev.serve", json.dumps(internal)] if internal else ["meshnode", "serve"]
    return subprocess.run([sys.executable, "-m", *entry, "--model", model, *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def assert_continues(got: dict, want: dict, jobs: dict, reason=None, prefix_if=None, deterministic=False):
    """Per session of `jobs`: its own stream is consistent, every requested token came, and it is the
    reference's: bitwise in deterministic mode, greedy and seeded alike; without it, a greedy one up to a
    tie (seeded ones part wherever a draw lands near a boundary, which logprobs cannot show).
    `prefix_if(result)` says which sessions may have been ended early."""
    for sid, kw in jobs.items():
        r = got[sid]
        early = bool(prefix_if and prefix_if(r))
        assert_consistent(r, None if early else kw["max_tokens"], None if early else reason)
        if deterministic or kw.get("sampling") is None:
            assert_as_promised(r, want[sid], deterministic, prefix=early)


def history(e):
    """A conversation so far: a 100-token prompt and the 30 tokens the model answered (greedy)."""
    q = [3 + (k * 13) % 500 for k in range(100)]
    return q, scenario(e, q, GREEDY, n_new=30)["tokens"]


def scenario(e, p, sampling, n_new=40, crowd=None, restart_after=None, warm=None, grammar=None, room=None):
    """Session x's tokens, logprobs and cached prompt tokens, and its neighbours' tokens, run by a
    deterministic scheduler: alone, or with `crowd` (a seed) others arriving at random ticks before and
    after it; with the engine's KV lost (a restart) after x generated `restart_after` tokens; after `warm`
    (a prompt) finished first; with at most `room` prompt tokens a tick (None: the default, 64). x ignores
    EOS unless it has a `grammar` (it ends when that is complete)."""
    e.step(Plan([], list(range(e.n_seq_max))))
    sched = Scheduler(NodeBudget.from_engine(e, max_prefill_tokens_per_tick=room), e.eog, NODE_POLICY,
                      recipe=e.recipe_fingerprint, deterministic=True)
    if warm:
        sched.submit(Session("warm", warm[0], len(warm[1]), ignore_eos=True, owner="c"))
        run_to_completion(sched, e)
    rng = random.Random(crowd)
    x = Session("x", p, n_new, sampling=sampling, ignore_eos=grammar is None, owner="c", grammar=grammar)
    arrivals = [(rng.randrange(12) if crowd is not None else 0, x)]
    for i in range(9 if crowd is not None else 0):
        arrivals.append((rng.randrange(40), Session(f"o{i}", [3 + rng.randrange(500) for _ in range(
            rng.choice([1, 2, 9, 63, 64, 70, 130, 200]))], rng.choice([1, 5, 30, 60]), ignore_eos=True, owner="o")))
    others = [s for _, s in arrivals[1:]]
    events, t, restarted = [], 0, restart_after is None
    while arrivals or not sched.idle:
        for when, s in [a for a in arrivals if a[0] <= t]:
            arrivals.remove((when, s))
            sched.submit(s)
        if not restarted and x.n_generated >= restart_after:
            e.step(Plan([], list(range(e.n_seq_max))))  # what a new engine process holds: nothing
            sched.engine_restarted()
            restarted = True
        events += run_tick(sched, e)
        t += 1
    mine = [ev for ev in events if ev.session is x and ev.kind == "tokens"]
    # per token: a multi-step tick's event carries several, as many as the ticks around it allowed
    return {"tokens": x.generated, "logprobs": [lp for ev in mine for lp in ev.logprobs or ()], "cached": x.n_reused,
            "others": {s.key: s.generated for s in others}}
