#!/usr/bin/env python3
"""Regenerate evidence/README.md (and the PNG plots, when matplotlib is installed) from the JSON.

Every figure in the README comes from a JSON file written by a benchmark run;
nothing here is typed by hand. Run the benchmarks (see the README's commands),
then `python evidence/render.py`.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import front  # noqa: E402
import node_sections  # noqa: E402
import sections  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name: str):
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def sweep_table(res: dict) -> list[str]:
    out = ["| concurrency | ticks | occupancy avg / max | tokens/tick | gen tok/s | TTFT p50 / p99 ms | "
           "ITL p50 / p99 ms | peak KV MiB | engine peak RSS MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["levels"]:
        out.append(f"| {r['concurrency']} | {r['ticks']} | {r['avg_batch_occupancy']:.2f} / {r['max_batch_occupancy']} "
                   f"| {r['tokens_per_tick']:.2f} | {r['gen_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.0f} / "
                   f"{r['ttft_ms_p99']:.0f} | {r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} | "
                   f"{r['peak_kv_bytes'] / 2**20:.2f} | {r['engine_peak_rss_bytes'] / 2**20:.0f} |")
    base = res["levels"][0]["gen_tokens_per_s"]
    out += ["", f"corruption_free: **{res['corruption_free']}** ({len(res['mismatches'])} mismatching jobs); "
                f"saturation_concurrency: **{res['saturation_concurrency']}**; occupancy plateaus at "
                f"concurrency {res.get('occupancy_plateau_concurrency')}; throughput at the highest level = "
                f"{res['levels'][-1]['gen_tokens_per_s'] / base:.2f}x concurrency {res['levels'][0]['concurrency']}."]
    for m in res["mismatches"]:
        out.append(f"- mismatch: concurrency {m['concurrency']} {m['job']} first differs at token {m['first_diff_pos']}")
    return out


def plots(sweeps: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[plot]'): README only, no plots", file=sys.stderr)
        return []
    made = []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, res in sweeps.items():
        c = [r["concurrency"] for r in res["levels"]]
        a1.plot(c, [r["gen_tokens_per_s"] for r in res["levels"]], "o-", label=name)
        a2.plot(c, [r["avg_batch_occupancy"] for r in res["levels"]], "o-", label=name)
    a1.set(xlabel="concurrency (max active sessions)", ylabel="generated tok/s", title="throughput", xscale="log", xticks=c)
    a2.set(xlabel="concurrency", ylabel="sequences per tick", title="average batch occupancy", xscale="log", xticks=c)
    for ax in (a1, a2):
        ax.set_xticklabels([str(x) for x in c])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "sweep.png"), dpi=110)
    made.append("sweep.png")
    return made


# the real model's node-vs-in-process runs, oldest first: each file's name and what its runs changed
REAL_OVERHEAD = [
    ("overhead-bench-smollm2", ""),
    ("overhead-bench-smollm2-calibrated", ", both sides on the node's policy and calibration (Scheduler.calibrated), "
                                          "multi-step ticks"),
    ("overhead-bench-smollm2-queued-steps", ", multi-step ticks also while the queue waits for a slot (the 16 jobs "
                                            "queue behind the concurrency), each row stopping on its end token"),
    ("overhead-bench-smollm2-node-budget", ", the in-process side on the node's own budget (the prefill room a tick "
                                           "has, where the runs above capped it at 64 tokens a tick and so flattered "
                                           "the node)"),
    ("overhead-bench-smollm2-kept", ", each side started once and kept across 18 rounds, as a serving node is, "
                                    "each round's prompts new (the runs above started every side afresh, 6 rounds)"),
    ("overhead-bench-smollm2-slack", ", a step count that misses decode_steps_ms by less than a tenth still runs "
                                     "(core/steps.py, STEPS_SLACK; the runs above: one step where 8 rows' steps "
                                     "took just over 25 ms)"),
]


def overhead_section(o: dict | None, name: str, intro: str = "", what: str = "bench model, 16 jobs, concurrency 8",
                     args: str = "--preset bench") -> list[str]:
    if not o:
        return []
    md = [f"## Node vs engine in-process ({what}){', no OpenMP' if intro else ''}", "",
          f"{intro}`meshnode bench overhead {args} --json evidence/{name}`"
          f" ({o.get('llama_build', 'llama.cpp build not recorded')})", "",
          "| run | in-process tok/s | node tok/s | ratio | lockstep node tok/s | ratio | engine wait p50 us | "
          "p90 | mean | lockstep p50 | lockstep mean |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, f in enumerate(o["runs"], 1):
        md.append(f"| {i} | {f['in_process_tok_s']:.1f} | {f['node_tok_s']:.1f} | {f['ratio']:.3f} | "
                  f"{f['lockstep_tok_s']:.1f} | {f['ratio_lockstep']:.3f} | {f['engine_wait_us_p50']:.0f} | "
                  f"{f['engine_wait_us_p90']:.0f} | {f['engine_wait_us_mean']:.0f} | "
                  f"{f['lockstep_wait_us_p50']:.0f} | {f['lockstep_wait_us_mean']:.0f} |")
    md += [""] if intro else ["", "The node pipelines ticks by default (the front plans tick N+1 while the engine runs tick N);",
           "the lockstep node (`--pipeline-depth 1`) is the same node without that. Engine wait is measured",
           "inside the engine process: its time between two steps, from one step's result being ready to the",
           "next step starting, over ticks that followed back to back. It holds everything the node adds to the",
           "loop that does not overlap a decode. Targets: ratio >= 0.97 and front + IPC < 150 us per tick.", ""]
    # a kept node's wait percentiles are its telemetry's window, not the round's alone (meshnode/bench/overhead.py)
    window = " (each over the node's last 1,024 ticks as its round ended)" if o.get("sides_kept") else ""
    median = (f"; the median of the rounds' ratios {o['ratio_median']:.3f} (lockstep {o['ratio_median_lockstep']:.3f})"
              if "ratio_median" in o else "")
    md += [f"All runs together: node / in-process = **{o['ratio_all_runs']:.3f}** (lockstep "
           f"{o['ratio_all_runs_lockstep']:.3f}){median}; engine wait per tick, median of the runs' p50{window}: "
           f"**{o['engine_wait_us_median']:.0f} us** (lockstep {o['lockstep_wait_us_median']:.0f} us).", ""]
    return md


def main() -> int:
    sweeps = {k: v for k, v in (("tiny", load("sweep-tiny.json")), ("bench", load("sweep-bench.json"))) if v}
    engine, overhead, peers = (load(f"{n}-bench.json") for n in ("engine", "overhead", "peers"))
    soak = load("soak-tiny.json")
    made = plots(sweeps)
    md = ["# Evidence", "",
          "Written by `python evidence/render.py` from the JSON files beside it; each JSON was written by the",
          "command shown, on this project's 2-core, 24 GiB, no-GPU machine. Re-run the commands, then the",
          "script, to refresh everything. Machines here are shared, so figures move by several percent between",
          "runs; each comparison below was measured side by side in one run.", ""]
    for name, res in sweeps.items():
        cmd = ("meshnode sweep --json evidence/sweep-tiny.json" if name == "tiny" else
               "meshnode sweep --preset bench --jobs 16 --prompt-len 4,16,32,64,100 --new-tokens 32 "
               "--json evidence/sweep-bench.json")
        md += [f"## Concurrency sweep, {name} model ({res['model']}, recipe {res['recipe']}, {res['jobs']} jobs)",
               "", f"`{cmd}`", "", *sweep_table(res), ""]
    if "sweep.png" in made:
        md += ["![throughput and occupancy vs concurrency](sweep.png)", ""]
    if engine:
        e = engine["engine"]
        md += ["## Engine batch scaling (bench model, in-process)", "", "`python -m benchmarks engine --preset bench "
               "--json evidence/engine-bench.json`", "", "| | decode tok/s | vs batch 1 |", "|---|---|---|",
               f"| Llama.generate, serial | {engine['llama_generate_serial']:.1f} | "
               f"{engine['llama_generate_serial'] / e['1']:.2f} |"]
        md += [f"| engine batch {b} | {r:.1f} | {r / e['1']:.2f} |" for b, r in e.items()]
        md += ["", f"Target batch 8 >= 3x batch 1: {e['8'] / e['1']:.2f}x.", ""]
    md += overhead_section(overhead, "overhead-bench.json")
    md += overhead_section(load("overhead-bench-no-openmp.json"), "overhead-bench-no-openmp.json",
                           "The same, on a llama.cpp built without OpenMP (README, Set-up): ")
    for name, what in REAL_OVERHEAD:  # the real model at 1 and 8 sessions, one file per level
        for c in (1, 8):
            md += overhead_section(load(f"{name}-c{c}.json"), f"{name}.json", args="--model smollm2-q8_0 --levels 1,8",
                                   what=f"SmolLM2-135M-Instruct q8_0, a real model, 16 jobs, concurrency {c}{what}")
    if peers:
        md += ["## Peer: llama-cpp-python serving one request at a time (bench model, 16 jobs)", "",
               "`meshnode bench peers --preset bench --json evidence/peers-bench.json`", "",
               f"Llama.generate serialized: {peers['serial_tok_s']:.1f} tok/s; the node at concurrency 8: "
               f"{peers['node_tok_s']:.1f} tok/s: **{peers['ratio']:.2f}x** (target >= 2.0x). "
               f"Greedy tokens identical for {peers['identical_jobs']}/{peers['jobs']} jobs.", ""]
    md += front.overhead_before_after()
    md += node_sections.burst() + node_sections.burst("burst-bench-smollm2.json", "SmolLM2-135M-Instruct q8_0, a real model",
                                                      "--model smollm2-q8_0")
    md += sections.ticks() + sections.layout() + sections.spec() + sections.kvroute() + sections.chat()
    md += sections.sampling()
    md += node_sections.abuse()
    md += node_sections.rpc()
    md += node_sections.structured()
    md += node_sections.gateway()
    md += node_sections.scale()
    md += node_sections.memory()
    md += front.priority()
    md += front.llamatests() + front.embed() + front.samples() + front.moves()
    md += sections.deterministic_sweeps()
    restarts = {k: v for k, v in (("tiny", load("restart-tiny.json")), ("bench", load("restart-bench.json"))) if v}
    if restarts:
        md += ["## Engine death: SIGKILL to the first token of the restarted engine, and what follows", ""]
        md += [f"- {k}: `python -m benchmarks restart --preset {k} --json evidence/restart-{k}.json`: "
               + ", ".join(f"{w:.2f} s" for w in v["waits_s"]) for k, v in restarts.items()]
        cont = {k: v for k, v in restarts.items() if "first_difference" in v}
        if cont:
            md += ["", "Sessions of several thousand tokens' context, the engine killed at the first one's token "
                       f"{next(iter(cont.values()))['kill_at']}, against the same run without a fault "
                       "(first token that differs):", "", "| model | " + " | ".join(
                           next(iter(cont.values()))["first_difference"]) + " |",
                   "|---|" + "---|" * len(next(iter(cont.values()))["first_difference"])]
            md += [f"| {k} ({v['continuation_tokens']} tokens) | " + " | ".join(
                "identical" if at is None else str(at) for at in v["first_difference"].values()) + " |"
                for k, v in cont.items()]
        md.append("")
    ipc_path = os.path.join(HERE, "ipc.txt")
    if os.path.exists(ipc_path):
        md += ["## Engine-link transport round trip (diagnostic)", "",
               "`python -m benchmarks ipc > evidence/ipc.txt`", "", "```", open(ipc_path).read().rstrip(), "```", ""]
    if soak:
        md += ["## Soak (tiny model)", "", f"`python -m benchmarks soak --preset tiny --minutes {soak['minutes']:g} "
               f"--kill-every {soak['kill_every_s']:g} --json evidence/soak-tiny.json`", "",
               f"submitted {soak['submitted']}, admitted {soak['admitted']}, completed {soak['completed']}, "
               f"rejected {soak['rejected']}, **lost {soak['lost']}**; engine kills {soak['kills']}, restarts "
               f"{soak['restarts']}; done reasons {soak['done_reasons']}.", "",
               "| t s | front RSS MiB | engine RSS MiB |", "|---|---|---|"]
        md += [f"| {t} | {f / 2**20:.1f} | {e / 2**20:.1f} |" for t, f, e in soak["rss"]]
        md.append("")
    md += ["## Limitations", "",
           "- CPU only, 2 cores: the front, the clients and llama.cpp's two threads share them, so the node's",
           "  per-tick overhead includes waiting for a core; on a bigger machine it shrinks.",
           "- On these 2 cores pipelining hides the front's work from the engine's gap between steps, not",
           "  from its CPU: the front and the benchmark's client run during the decode and slow it down. Single",
           "  rounds of the overhead bench swing far more than that cost (see the tables), so its verdict uses",
           "  all its rounds together (18 a level, on sides kept across them, since 2026-12-06).",
           "- The demo models have random weights: throughput is real, text is not meaningful.",
           "- llama.cpp is not batch-invariant: with f16 weights, greedy tokens can differ when the same job",
           "  shares ticks with different neighbours (seen rarely on the bench model, never on the f32 tiny",
           "  model); the sweep reports every such mismatch instead of hiding it.", ""]
    with open(os.path.join(HERE, "README.md"), "w") as f:
        f.write("\n".join(md))
    print(f"wrote evidence/README.md{''.join(', evidence/' + m for m in made)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
