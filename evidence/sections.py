"""evidence/README.md sections for one user and the engine: layouts, speculation, KV routing, chat, ticks, sampling,
deterministic sweeps (render.py calls them; the node under load is node_sections.py's)."""
from __future__ import annotations

import glob
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name: str) -> dict | None:
    path = os.path.join(HERE, name)
    return json.load(open(path)) if os.path.exists(path) else None


def layout() -> list[str]:
    d = load("layout-bench.json")
    if not d or "cost" not in d:
        return []
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    units = {"mix": "tok/s", "decode": "tok/s", "burst": "last first token s", "chat": "wall s", "lone": "ms/token"}
    modes = list(d["rounds"])
    md = ["## Deterministic mode vs not (bench model)", "",
          "`python -m benchmarks layout --preset bench --rounds 3 --json evidence/layout-bench.json`, on "
          f"{d.get('build', 'the stock build')}: through fresh nodes, the modes' order rotating per round, "
          "the mix (16 jobs, prompts 4-100, 32 new, concurrency 8), pure decode (8 sessions x 128 tokens), the "
          "prefill burst (4 decoding, 4 x 1,000-token prompts), multi-turn chat (8 users x 3 turns, prefix "
          "cache on) and one session decoding 128 tokens alone.", "",
          "| workload | measure | " + " | ".join(f"{m} (rounds)" for m in modes) + " | deterministic's cost per round |",
          "|---|---|" + "---|" * len(modes) + "---|"]
    for w, unit in units.items():
        cells = [f"{mean([r[w] for r in d['rounds'][m]]):.2f} ({', '.join(f'{r[w]:.2f}' for r in d['rounds'][m])})"
                 for m in modes]
        cost = d["cost"].get("deterministic", {}).get(w, [])
        md.append(f"| {w} | {unit} | " + " | ".join(cells) + " | " + ", ".join(f"{c:+.1%}" for c in cost) + " |")
    return md + ["", "A positive cost is deterministic mode slower (docs/determinism.md reads it).", ""]


def spec() -> list[str]:
    out = []
    for name, model in (("", "q8_0"), ("-q4_1", "Q4_1, as packaged"), ("-f16", "f16"), ("-q4_k_m", "q4_K_M")):
        arg = {"": "smollm2-q8_0", "-q4_1": "smollm2"}.get(name, f"smollm2{name}")
        out += _spec(f"spec-bench-smollm2{name}.json", f"node defaults vs llama-server's (SmolLM2-135M-Instruct "
                     f"{model}, a real model)", f"--model {arg} --llama-server PATH --rounds 3")
    return out + _spec(
        "spec-draft-bench-smollm2.json", "a draft model (SmolLM2 Q4_1 drafting for its f16 copy, a real model)",
        "--model smollm2-f16 --draft-model smollm2 --llama-server PATH --sides ... --rounds 3") + _spec(
        "spec-f16-bench-smollm2.json", "the f16 target, prompt lookup and the draft model vs llama-server's ngram "
        "(SmolLM2-135M-Instruct f16, a real model)",
        "--model smollm2-f16 --draft-model smollm2 --llama-server PATH --sides ... --rounds 2") + _rows()


def kvroute() -> list[str]:
    d = load("kvroute-smollm2.json")
    if not d:
        return []
    pairs, base = d["pairs"], d["pairs"]["f16/f16"]
    depths, pre = list(base["lone_ms"]), list(base["prefill_ms"])
    md = ["## K/V cache types: a lone row's bits, speed and quality (SmolLM2-135M-Instruct q8_0)", "",
          f"`python -m benchmarks kvroute --model smollm2-q8_0 --json evidence/kvroute-smollm2.json`, on {d['build']}, "
          f"{d['threads']} threads: a lone row unpadded beside 1, 2 and 7 neighbours at {d['depth']} cells (bitwise), "
          "ms a token of a lone row by depth, prefill ms, and the perplexity of "
          f"{os.path.basename(d['text'])} ({d['text_tokens']} tokens). docs/determinism.md reads it.", "",
          "| K/V | lone row keeps its bits | " + " | ".join(f"ms at {x}" for x in depths) + " | "
          + " | ".join(f"prefill {x}" for x in pre) + " | perplexity |", "|---|---|" + "---|" * (len(depths) + len(pre) + 1)]
    for name, row in pairs.items():
        same = "yes" if all(row["bitwise"].values()) else "no"
        md.append(f"| {name} | {same} | " + " | ".join(f"{row['lone_ms'][x]:.2f}" for x in depths) + " | "
                  + " | ".join(f"{row['prefill_ms'][x]:.0f}" for x in pre) + f" | {row['perplexity']:.4f} |")
    pad = base.get("padded_ms", {})
    if pad:
        md.append("| f16/f16 with a padding row | (deterministic mode) | " + " | ".join(f"{pad[x]:.2f}" for x in depths)
                  + " |" + " - |" * (len(pre) + 1))
    return md + [""]


def _rows() -> list[str]:
    d = load("rows-bench-smollm2.json")
    if not d:
        return []
    md = ["### What K drafts cost: a tick of one sequence's n rows (SmolLM2-135M-Instruct q8_0)", "",
          f"`python -m benchmarks rows --model smollm2-q8_0 --json evidence/rows-bench-smollm2.json`, on {d['build']}: in "
          f"process, one sequence at depth {d['depth']}, the fastest of 5 ticks, ms (x one row's).", "",
          "| mode | " + " | ".join(f"{n} rows" for n in next(iter(d["ms"].values()))) + " |",
          "|---|" + "---|" * len(next(iter(d["ms"].values())))]
    for mode, ms in d["ms"].items():
        one = ms["1"]
        md.append(f"| {mode} | " + " | ".join(f"{v:.1f} ({v / one:.2f}x)" for v in ms.values()) + " |")
    return md + [""]


def _spec(name: str, title: str, args: str) -> list[str]:
    d = load(name)
    if not d:
        return []
    sides = list(d["rounds"][0])
    tasks = [t for t, v in d["rounds"][0][sides[0]].items() if isinstance(v, dict) and t != "crowd"]
    md = [f"## One user alone: {title}", "",
          f"`python -m benchmarks spec {args} --json evidence/{name}`, on {d['build']}: one session alone, greedy, "
          f"up to {d['new_tokens']} new tokens, the same rendered prompt tokens to every side (code-edit: a 40-line "
          f"file asked back with one function renamed, {d['prompt_tokens']['code-edit']} tokens; the others free "
          "chats); decode tok/s from the first token to the last, median of the rounds; crowd: 8 code-edit "
          "sessions at once (node only). docs/speculative.md and docs/determinism.md read it.", "",
          "| side | " + " | ".join(tasks) + " | crowd of 8 |", "|---|" + "---|" * (len(tasks) + 1)]
    for side in sides:
        cells = [f"{np.median([r[side][t]['tok_s'] for r in d['rounds']]):.1f}" for t in tasks]
        crowd = [r[side]["crowd"]["tok_s"] for r in d["rounds"] if "crowd" in r[side]]
        md.append(f"| {side} | " + " | ".join(cells) + f" | {f'{np.median(crowd):.1f}' if crowd else '-'} |")
    return md + [""] + [f"- {v}" for v in d["verdicts"]] + [""]


def chat() -> list[str]:
    d = load("chat-bench.json")
    if not d:
        return []
    w = d["workload"]
    md = ["## Multi-turn chat: prefix cache on vs off vs llama-server (bench model)", "",
          "`python -m benchmarks chat --preset bench --rounds 3 --llama-server PATH --json evidence/chat-bench.json`: "
          f"{w['users']} users x {w['turns']} turns, a {w['system']}-token system prompt shared by all, "
          f"+{w['new']} tokens a turn, {w['gen']} generated; every turn re-sends the conversation. llama-server: "
          "built from the same vendored llama.cpp, one slot per user, prompt caching on.", "",
          "| round | run | wall s | first-token p50 turns 2+ ms | p50 by turn ms | p90 by turn ms | reused tokens |",
          "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(d["rounds"], 1):
        for name in ("cache_on", "cache_off", "llama_server"):
            if name in r:
                f = r[name]
                md.append(f"| {i} | {name} | {f['wall_s']:.2f} | {f['ttft_ms_p50_later_turns']} | "
                          f"{f['ttft_ms_p50_by_turn']} | {f['ttft_ms_p90_by_turn']} | "
                          f"{'not reported' if name == 'llama_server' else format(f['cached_tokens'], ',')} |")
    rounds = d["rounds"]
    sp = [r["cache_off"]["wall_s"] / r["cache_on"]["wall_s"] for r in rounds]
    md += ["", f"Cache on vs off: **{min(sp):.2f}x-{max(sp):.2f}x** faster (target >= 2x). Answers identical with "
               f"the cache on and off: {', '.join(str(r['identical_answers']) for r in rounds)} of "
               f"{w['users'] * w['turns']} per round."]
    if rounds and "llama_server" in rounds[0]:
        wall = [r["cache_on"]["wall_s"] / r["llama_server"]["wall_s"] for r in rounds]
        ttft = [r["cache_on"]["ttft_ms_p50_later_turns"] / r["llama_server"]["ttft_ms_p50_later_turns"] for r in rounds]
        md.append(f"Node / llama-server: wall **{min(wall):.2f}-{max(wall):.2f}**, first-token p50 of turns 2+ "
                  f"**{min(ttft):.2f}-{max(ttft):.2f}** (targets <= 1).")
    return md + [""]


def ticks() -> list[str]:
    d = load("tick-shapes.json")
    if not d:
        return []
    m, r = d["median_ms"], d["ratios"]
    md = ["## What a tick costs by shape (bench model, engine alone)", "",
          f"`python -m benchmarks ticks --preset bench --rounds {d['rounds']} --json evidence/tick-shapes.json`: streams "
          "layout, each shape timed once a round, interleaved; medians over rounds.", "",
          f"| prompt chunk | at position 0, ms | per row | at position {d['deep']}, ms | per row |", "|---|---|---|---|---|"]
    for n in (32, 63, 64, 128, 146, 192):
        a, b = m[f"chunk {n} at 0"], m[f"chunk {n} at {d['deep']}"]
        md.append(f"| {n} | {a:.1f} | {a / n:.2f} | {b:.1f} | {b / n:.2f} |")
    md += ["", f"- at position {d['deep']}, 63 rows take **{r['row_by_row_vs_tiled_at_depth']:.2f}x** the time of 64 "
           "(llama.cpp's CPU flash attention goes row by row under 64 rows, tiles from 64)",
           f"- 146 rows cost {r['partial_tile_per_row_vs_whole']:.2f}x per row what 128 do (a partial last tile is "
           "computed whole)",
           f"- 4 decode rows beside a 192-token chunk add {r['beside_decode_extra_ms']:.1f} ms; alone they take "
           f"{r['decode_alone_ms']:.1f} ms",
           f"- the engine alone, {d['decode_steps']} steps of 4 decode rows: p99 / p50 = "
           f"**{r['decode_steps_p99_over_p50']:.2f}** (the floor under the node's steady inter-token p99 on this "
           "machine)", ""]
    return md


def sampling() -> list[str]:
    d = load("sampling-bench.json")
    if not d:
        return []
    m, a = d["step_ms_median"], d["sampling_alone_ms"]
    return ["## Sampling options' cost (bench model)", "",
            "`python -m benchmarks sampling --preset bench --rounds 3 --json evidence/sampling-bench.json`: a decode tick "
            f"of {d['batch']} sequences, greedy vs every option on (temperature, top-k 40, top-p, min-p, the three "
            "penalties over 64 tokens, logprobs 5), rounds alternating.", "",
            f"Engine step (median of rounds): greedy **{m['greedy']:.2f} ms**, all options **{m['everything']:.2f} "
            f"ms** ({d['extra_ratio']:+.1%}). Sampling alone for {d['batch']} rows: greedy {a['greedy']:.2f} ms, "
            f"all options {a['everything']:.2f} ms.", ""]


def deterministic_sweeps() -> list[str]:
    runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(HERE, "sweep-bench-default-*.json")))]
    if not runs:
        return []
    md = ["## Default settings (deterministic mode where it holds): the same jobs at every concurrency (bench model)",
          "", "`python -m meshnode sweep --preset bench --jobs 16 --prompt-len 4,16,32,64,100 --new-tokens 32 "
          "--json evidence/sweep-bench-default-N.json`, on the stock build, five times (evidence/run_all.sh).", ""]
    for i, r in enumerate(runs, 1):
        md.append(f"- run {i} (deterministic {r.get('deterministic')}): {_sweep_verdict(r)}")
    return md + [""]


def _sweep_verdict(r: dict) -> str:
    levels = ", ".join(str(lv["concurrency"]) for lv in r.get("levels", []))
    return (f"concurrency {levels}: corruption-free **{r['corruption_free']}**, {len(r['mismatches'])} job(s) whose "
            f"tokens differ from concurrency {r['reference_concurrency']}")
