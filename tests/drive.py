"""A minimal engine driver for tests: prefill in chunks, then decode, per plan rules."""
import numpy as np

from meshnode.engine.plan import GREEDY, Plan, SeqChunk


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
