"""`meshnode sweep`: the same jobs through fresh nodes at concurrency 1, 2, 4, 8.

Each level starts a real node (front + engine processes, --max-active =
level), submits every job at once through the ZeroMQ client (the queue holds
the rest) and measures from the client side. Then two verdicts:
- corruption_free: every job's tokens equal the concurrency-1 run at every
  level; each mismatch is reported with its first differing position.
- saturation_concurrency: the smallest level within 5 % of the best throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np


SATURATION_TOLERANCE = 0.05


def add_args(p) -> None:
    p.add_argument("--model", help="a GGUF (default: the preset's demo model)")
    p.add_argument("--preset", default="tiny", choices=["tiny", "tiny-f16", "bench"])
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="nodes with deterministic mode required (refused where it cannot hold) or off; unset: the "
                        "node's default (on wherever it holds)")
    p.add_argument("--levels", default="1,2,4,8", help="comma-separated concurrency levels")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--prompt-len", default="4,16,32,64", help="prompt lengths, cycled over the jobs")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", help="write the results here")


def make_jobs(n: int, prompt_lens: list[int], new_tokens: int, n_vocab: int = 512) -> list[dict]:
    """Deterministic token prompts (token ids 3.. avoid control tokens)."""
    jobs = []
    for i in range(n):
        length = prompt_lens[i % len(prompt_lens)]
        jobs.append({"id": f"job{i}", "tokens": [3 + (i * 131 + k * 17) % (n_vocab - 3) for k in range(length)],
                     "max_tokens": new_tokens})
    return jobs


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3) if values else 0.0


def run_level(model: str, level: int, jobs: list[dict], threads: int = 0, internal: dict | None = None,
              progress=None, deterministic: bool | None = None) -> tuple[dict, dict[str, list[int]]]:
    args = ["--max-active", str(level), "--max-queue", str(len(jobs)), "--threads", str(threads),
            *([] if deterministic is None else ["--deterministic" if deterministic else "--no-deterministic"]),
            "--log-level", "WARNING"]
    from meshnode.dev.nodeproc import NodeProcess  # here: building the CLI's parser imports this module

    with NodeProcess(model, *args, internal=internal) as node, node.client(timeout_s=600) as c:
        t0 = time.monotonic()
        for j in jobs:
            c.submit(j["id"], tokens=j["tokens"], max_tokens=j["max_tokens"], ignore_eos=True)
        results = c.collect([j["id"] for j in jobs], timeout_s=600,
                            on_end=(lambda done, total: progress(level, done, total)) if progress else None)
        wall = time.monotonic() - t0
        status = c.status()
        tele, node = status["telemetry"], status["node"]
    ttft = [(r.token_times[0] - t0) * 1e3 for r in results.values() if r.token_times]
    itl = [d * 1e3 for r in results.values() for d in np.diff(r.token_times)]
    generated = sum(len(r.tokens) for r in results.values())
    row = {
        "concurrency": level, "recipe": node["recipe"], "deterministic": node["deterministic"],
        "ticks": tele["ticks_total"],
        "avg_batch_occupancy": tele["batch_occupancy_avg"], "max_batch_occupancy": tele["batch_occupancy_max"],
        "tokens_per_tick": round(tele["decode_tokens_total"] / max(1, tele["ticks_total"]), 4),
        "gen_tokens_per_s": round(generated / wall, 3), "wall_s": round(wall, 3),
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
        "peak_kv_bytes": tele["kv_used_peak_bytes"], "engine_peak_rss_bytes": tele["engine"]["rss_peak_bytes"],
        "ended": sorted({(r.done or r.admission).get("reason", "?") for r in results.values()}),
    }
    return row, {sid: r.tokens for sid, r in results.items()}


def find_mismatches(reference: dict[str, list[int]], level: int, got: dict[str, list[int]]) -> list[dict]:
    out = []
    for sid, want in reference.items():
        have = got.get(sid, [])
        if have != want:
            first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
            out.append({"concurrency": level, "job": sid, "first_diff_pos": first,
                        "expected_len": len(want), "got_len": len(have)})
    return out


def saturation(levels: list[dict], key: str = "gen_tokens_per_s") -> int | None:
    """The smallest concurrency whose `key` is within 5 % of the best level's."""
    if not levels:
        return None
    best = max(r[key] for r in levels)
    return min(r["concurrency"] for r in levels if r[key] >= (1 - SATURATION_TOLERANCE) * best)


def sweep(model: str, levels: list[int], jobs: list[dict], threads: int = 0, internal_by_level: dict | None = None,
          deterministic: bool | None = None,
          progress=None) -> dict:
    rows, outputs = [], {}
    for level in levels:
        row, out = run_level(model, level, jobs, threads, (internal_by_level or {}).get(level), progress,
                             deterministic)
        rows.append(row)
        outputs[level] = out
    ref_level = min(levels)
    mismatches = [m for lv in levels if lv != ref_level for m in find_mismatches(outputs[ref_level], lv, outputs[lv])]
    return {
        "model": os.path.basename(model),
        "recipe": rows[0]["recipe"],
        "deterministic": rows[0]["deterministic"],  # in effect, as the nodes said
        "levels": rows,
        "corruption_free": not mismatches,
        "mismatches": mismatches,
        "saturation_concurrency": saturation(rows),
        "occupancy_plateau_concurrency": saturation(rows, "avg_batch_occupancy"),
        "reference_concurrency": ref_level,
        "jobs": len(jobs),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }


def print_table(res: dict) -> None:
    print(f"model {res['model']}  recipe {res['recipe']}  deterministic {res['deterministic']}  jobs {res['jobs']}")
    head = ["conc", "ticks", "occ avg", "occ max", "tok/tick", "gen tok/s", "TTFT p50", "TTFT p99",
            "ITL p50", "ITL p99", "peak KV", "eng RSS"]
    print("".join(f"{h:>10}" for h in head))
    for r in res["levels"]:
        vals = [r["concurrency"], r["ticks"], f"{r['avg_batch_occupancy']:.2f}", r["max_batch_occupancy"],
                f"{r['tokens_per_tick']:.2f}", f"{r['gen_tokens_per_s']:.1f}", f"{r['ttft_ms_p50']:.0f}",
                f"{r['ttft_ms_p99']:.0f}", f"{r['itl_ms_p50']:.1f}", f"{r['itl_ms_p99']:.1f}",
                f"{r['peak_kv_bytes'] / 2**20:.1f}M", f"{r['engine_peak_rss_bytes'] / 2**20:.0f}M"]
        print("".join(f"{v:>10}" for v in vals))
    print(f"corruption_free: {res['corruption_free']}"
          + "".join(f"\n  MISMATCH concurrency {m['concurrency']} {m['job']} first differs at token "
                    f"{m['first_diff_pos']}" for m in res["mismatches"]))
    print(f"saturation_concurrency: {res['saturation_concurrency']} (within {SATURATION_TOLERANCE:.0%} of the best "
          f"throughput); occupancy plateaus at concurrency {res['occupancy_plateau_concurrency']}")


def _progress(level: int, done: int, total: int) -> None:
    sys.stderr.write(f"\r  concurrency {level}: {done}/{total} jobs done ")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def main(a) -> int:
    if a.model:
        model = a.model
    else:
        from meshnode.ops.models import cached_model

        model = str(cached_model(a.preset))
    levels = [int(x) for x in a.levels.split(",")]
    jobs = make_jobs(a.jobs, [int(x) for x in a.prompt_len.split(",")], a.new_tokens)
    from meshnode.bench import llama_build

    print(llama_build())
    if a.deterministic:
        from meshnode.engine.llamacpp import deterministic_problem

        problem = deterministic_problem(model)
        if problem:
            print(f"meshnode sweep: {problem}", file=sys.stderr)
            return 2
    res = sweep(model, levels, jobs, a.threads, deterministic=a.deterministic, progress=_progress)
    print_table(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["corruption_free"] else 1
