"""`meshnode bench drafts`: what deterministic mode's drafted row gives a session decoding alone.

A lone decode row carries a draft of its next token (meshnode/engine/drafts.py); how often
the draft is right depends on the text, and a model of random weights does not repeat
itself, so the bench shows the two ends and the model's own case, through fresh nodes, in
rounds whose order rotates:
- `flat`: the preset's shape with an all-zero output matrix, so every logit is equal: greedy
  answers one token over and over (every draft right: the ceiling), seeded sampling draws at
  random (nearly every draft wrong: the cost of the row, as the dummy it replaced);
- `model`: the preset itself, greedy (prompt lookup on text that does not repeat);
each in deterministic mode and with `--no-deterministic` (no second row at all). Measured: ms
between tokens of one 200-token session (3 a node), and the drafts made and served (telemetry).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from meshnode.bench import llama_build, model_path, steady_rate
from meshnode.core.types import Sampling
from meshnode.dev.nodeproc import NodeProcess

NEW, SESSIONS = 200, 3
SEEDED = Sampling(temperature=1.0, seed=3)


def flat_model(preset: str, directory: str) -> str:
    from meshnode.ops.models import make_model

    return str(make_model(Path(directory) / f"flat-{preset}.gguf", preset, 0, flat=True))


def lone(path: str, threads: int, mode: tuple, sampling: Sampling | None) -> dict:
    with NodeProcess(path, "--threads", str(threads), "--log-level", "WARNING", *mode) as node, \
            node.client(timeout_s=600) as c:
        c.generate("warm", tokens=[3, 4, 5], max_tokens=8, ignore_eos=True)
        ms = []
        for i in range(SESSIONS):
            r = c.generate(f"x{i}", tokens=[3 + (k * 7 + i) % 500 for k in range(32)], max_tokens=NEW,
                           ignore_eos=True, sampling=sampling)
            ms.append(steady_rate([r.token_times])[1])
        e = c.status()["telemetry"]["engine"]
    return {"ms_per_token": float(np.median(ms)), "drafted": e["drafted_rows_total"],
            "served": e["drafts_served_total"]}


def main(a) -> int:
    import tempfile

    threads = a.threads or os.cpu_count()
    path = model_path(a)
    print(f"bench drafts: {os.path.basename(path)} and its flat twin, threads {threads}, {a.rounds} rounds; "
          f"{llama_build()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        flat = flat_model(a.preset, tmp) if not a.model else None
        sides = {"model greedy": (path, None)}
        if flat:
            sides |= {"flat greedy (drafts right)": (flat, None), "flat seeded (drafts wrong)": (flat, SEEDED)}
        runs = [(f"{name}, {mode}", path_, smp, args) for name, (path_, smp) in sides.items()
                for mode, args in (("deterministic", ("--deterministic",)), ("off", ("--no-deterministic",)))]
        rounds = []
        for r in range(a.rounds):
            order = runs[r % len(runs):] + runs[:r % len(runs)]
            got = {name: lone(p, threads, args, smp) for name, p, smp, args in order}
            rounds.append({name: got[name] for name, *_ in runs})
            for name, f in rounds[-1].items():
                print(f"  round {r + 1} {name:<42} {f['ms_per_token']:6.2f} ms a token; drafted {f['drafted']}, "
                      f"served {f['served']}", flush=True)
    verdicts = []
    for name in sides:
        on = [rd[f"{name}, deterministic"]["ms_per_token"] for rd in rounds]
        off = [rd[f"{name}, off"]["ms_per_token"] for rd in rounds]
        ratio = [x / y for x, y in zip(on, off)]
        verdicts.append(f"{name}: deterministic / off {np.median(ratio):.2f} (rounds "
                        f"{', '.join(f'{v:.2f}' for v in ratio)}); {np.median(on):.2f} vs {np.median(off):.2f} "
                        "ms a token")
    for line in verdicts:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": threads, "build": llama_build(), "new_tokens": NEW,
                       "rounds": rounds, "verdicts": verdicts}, f, indent=1)
    return 0
