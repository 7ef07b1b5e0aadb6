"""evidence/README.md sections for the node under load: bursts, RPC, structured output, the gateway, scale,
memory, abuse (render.py calls them)."""
from __future__ import annotations

import numpy as np

from sections import load


def burst(name: str = "burst-bench.json", model: str = "bench model", args: str = "--preset bench") -> list[str]:
    d = load(name)
    if not d or "rounds" not in d:
        return []
    md = [f"## Prefill burst: tick target vs whole-batch ticks vs fixed chunk vs llama-server ({model})", "",
          f"`meshnode bench burst {args} --rounds {len(d['rounds'])} --llama-server PATH --json evidence/{name}`: "
          f"4 sessions decoding, then 4 arrive with {d['burst_prompt']}-token prompts, on {d.get('build', 'an unrecorded build')}. "
          "`node`: default settings (streams layout, prefill sized by the tick target: "
          + (f"{d['tick_target_ratio']:g} decode ticks, all their steps" if d.get("tick_target_ms") is None and d.get("tick_target_ratio")
             else f"{d.get('tick_target_ms', 450):g} ms") + "); `node_whole_batch`: `--tick-target-ms 60000` "
          "(no tick bound: each tick carries the prefill room, the other end of the trade); `node_fixed_64`: `--tick-target-ms 0 --prefill-chunk 64`; llama-server with 8 slots "
          "(`-np 8 -c 8192`). The node's "
          "`capacity` estimate for a 1,000-token prompt is checked against the measured first-token delay (idle: a "
          "lone prompt after a small warm-up job; busy: the first burst prompt).", "",
          "Gaps are between the token events a stream gets (the node's decode ticks of several steps send a few "
          "tokens in one, llama-server one a token), so the streams' speed is given too.", "",
          "| round | run | steady tok/s a stream | gap p50 ms | p99 | burst worst gap ms | burst first token, first / last "
          "ms | estimate idle / busy ms | measured idle / busy ms |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(d["rounds"], 1):
        for name, f in r.items():
            est = (f"{f['idle_estimate_ms']} / {f['busy_estimate_ms']}" if "idle_estimate_ms" in f else "")
            meas = (f"{f['idle_measured_ms']:.0f} / {f['busy_measured_ms']:.0f}" if "idle_measured_ms" in f else "")
            rate = f"{f['steady_tok_s']:.1f}" if "steady_tok_s" in f else ""
            md.append(f"| {i} | {name} | {rate} | {f['steady_itl_ms_p50']:.1f} | {f['steady_itl_ms_p99']:.1f} | "
                      f"{f['burst_itl_ms_max']:.0f} | {f['burst_ttft_ms_first']:.0f} / {f['burst_ttft_ms_max']:.0f} | "
                      f"{est} | {meas} |")
    md += [""] + [f"- {v}" for v in d.get("verdicts", [])]
    models = [r["node"]["tick_model"] for r in d["rounds"] if "tick_model" in r["node"]]
    if models:
        md.append("- the node's tick model after each burst: correction (median / 90th percentile of measured over "
                  "fitted) " + ", ".join(f"{m['correction']} / {m['correction_bound']}" for m in models)
                  + "; ticks over twice their prediction: " + ", ".join(str(m["outliers_total"]) for m in models))
    if models and d.get("tick_target_ratio") and "llama_server" in d["rounds"][0]:
        call = float(np.median([m["ms_per_call"] for m in models]))
        row = float(np.median([m["ms_per_row"] for m in models]))
        p50 = float(np.median([r["node"]["steady_itl_ms_p50"] for r in d["rounds"]]))
        tick = d["tick_target_ratio"] * p50
        share = 1 - (2 * call + 4 * row) / tick
        md.append(f"- the trade-off, from the fitted costs ({call:.1f} ms a llama_decode call, {row:.2f} ms a row): "
                  f"on streams a tick with prompt rows beside decode rows is two calls (llama.cpp's split_equal puts "
                  f"the 1-token rows and a prompt chunk in separate ubatches), so at {d['tick_target_ratio']:g} decode "
                  f"ticks ({tick:.0f} ms) at most {share:.0%} of a tick is prompt rows, "
                  f"where llama-server's 512-row ubatches, the decode rows inside, spend "
                  f"{1 - call / (call + 512 * row):.0%}: the last burst prompt starts later, for a worst gap "
                  f"{np.median([r['llama_server']['burst_itl_ms_max'] / r['node']['burst_itl_ms_max'] for r in d['rounds']]):.0f}x "
                  "shorter than llama-server's")
    return md + [""]


def rpc() -> list[str]:
    d = load("rpc-bench.json")
    if not d:
        return []
    md = ["## One model over ggml RPC workers (bench model)", "",
          "`python -m benchmarks rpc --preset bench --rounds 3 --json evidence/rpc-bench.json`, on "
          f"{d['build']}: through fresh nodes, the sides' order rotating per round; the workers are "
          "`meshnode rpc-worker` processes on this same host (their compute shares its cores with the node's), "
          "the delays a Python proxy holding each chunk half the round trip each way (no netem in this kernel). "
          "One session decoding (c1), eight together (c8), one 512-token prompt (prefill); medians of rounds.", "",
          "| side | c1 tok/s | c8 tok/s | c8 / c1 | prefill tok/s | c1, c8, prefill vs local |", "|---|---|---|---|---|---|"]
    for name, m in d["table"].items():
        md.append(f"| {name} | {m['c1_tok_s']:.1f} | {m['c8_tok_s']:.1f} | {m['c8_over_c1']:.1f}x | {m['prefill_tok_s']:.0f} | "
                  f"{m['c1_vs_local']:.2f}, {m['c8_vs_local']:.2f}, {m['prefill_vs_local']:.2f} |")
    return md + [""] + [f"- {line}" for line in d["verdict"]] + [""]


def structured() -> list[str]:
    md = []
    for name, what in (("structured-bench-32k.json", "bench-32k: 32,768-token BPE vocab"),
                       ("structured-bench.json", "bench model: 512-token vocab")):
        d = load(name)
        if not d:
            continue
        if not md:
            md = ["## Structured output: a decode tick with JSON-schema rows, vs llama-server's json_schema", "",
                  f"`python -m benchmarks structured --preset PRESET --rounds 3 --llama-server PATH --json evidence/...`, on "
                  f"{d['build']}: through a node (deterministic mode, its default), a node with `--no-deterministic` "
                  "and llama-server built from the same llama.cpp, the order rotating per round; every session "
                  f"{d['new_tokens']} tokens at temperature 1, the constrained ones to an array-of-objects schema that "
                  "cannot complete sooner. ms per decode tick, medians of rounds.", ""]
        cases = list(next(iter(d["median_ms_per_tick"].values())))
        md += [f"**{what}**", "", "| side | " + " | ".join(cases) + " | constraining 8 of 8 rows costs |",
               "|---|" + "---|" * (len(cases) + 1)]
        for side, m in d["median_ms_per_tick"].items():
            md.append(f"| {side} | " + " | ".join(f"{m[c]:.1f}" for c in cases) + f" | {d['constrained_share_b8'][side]:+.1%} |")
        md += [""] + [f"- {line}" for line in d["verdict"][-3:]] + [""]
    libs = load("constraint-libs.json")
    if libs:
        md += ["Why llguidance (`tools/constraint_libs.py`, in a venv with both libraries): on the bench-32k vocab and "
               f"the same schema, over a walk of {libs['tokens']} tokens, one row's bitmask took "
               f"{libs['llguidance_mask_ms_median']:.3f} ms (p90 {libs['llguidance_mask_ms_p90']:.3f}) with llguidance "
               f"and {libs['xgrammar_mask_ms_median']:.3f} ms (p90 {libs['xgrammar_mask_ms_p90']:.3f}) with xgrammar; "
               f"compiling, {libs['llguidance_compile_ms']:.1f} ms and {libs['xgrammar_compile_ms']:.1f} ms. Both are "
               "under 0.1 % of a tick, so speed does not decide: xgrammar needs torch, transformers and triton "
               "(over a GB a CPU node does not otherwise install), llguidance builds its tokenizer from llama.cpp's "
               "own vocab and reads llama.cpp's GBNF, and llama.cpp itself uses it.", ""]
    return md


def gateway() -> list[str]:
    d, stacks = load("gateway-bench.json"), load("http-stacks.json")
    md = []
    if d:
        md = ["## The OpenAI HTTP gateway (bench model)", "",
              "`meshnode bench gateway --preset bench --rounds 3 --llama-server PATH --json evidence/gateway-bench.json`, "
              f"on {d['build']}: one node with its gateway child; the same greedy sessions through the ZeroMQ client "
              "and the gateway's streamed /v1/completions, and the 16-job mix and `bench burst`'s burst through the gateway "
              "and llama-server's /v1/completions (llama-server running only for its sides, fresh prompts each round), "
              "the order rotating per round. The table's medians mix rounds, and this machine's one-session tick "
              "moves between rounds on both paths (c1 gap p50 by round, ZeroMQ / HTTP: "
              + ", ".join(f"{z['gap_p50_ms']:.1f} / {h['gap_p50_ms']:.1f}"
                          for z, h in zip(d["runs"]["c1 zmq"], d["runs"]["c1 http"]))
              + " ms): read the gateway's cost from the lines paired by round below. Client, gateway, front and "
              "engine share the 2 cores.", "",
              "| path | tok/s | first token p50 ms | gap p50 ms | gap p99 ms |", "|---|---|---|---|---|"]
        for name, m in d["median"].items():
            if "tok_s" in m:  # the burst's figures are in the verdict
                md.append(f"| {name} | {m['tok_s']:.1f} | {m['ttft_p50_ms']:.1f} | {m['gap_p50_ms']:.1f} | {m['gap_p99_ms']:.1f} |")
        md += [""] + [f"- {line}" for line in d["verdict"]] + [""]
    for file, threads, why in (("gateway-pairs.json", "", ""),
                               ("gateway-pairs-threads1.json", " --threads 1",
                                " The same with the engine on one thread, so that a core is left to the front, the "
                                "gateway and the client: what the gateway costs when it does not take the engine's "
                                "CPU.")):
        pairs = load(file)
        if not pairs:
            continue
        n = len(next(iter(pairs["runs"].values())))
        md += ["The gateway's own cost, longer streams and more rounds: "
               f"`meshnode bench gateway --preset bench{threads} "
               f"--rounds {n} --sides 'c1 zmq,c1 http,c8 zmq,c8 http' --tokens {pairs['tokens_per_session']} --json "
               f"evidence/{file}` (the same node, the ZeroMQ client and the gateway on alternating turns).{why}", ""]
        md += [f"- {line}" for line in pairs["verdict"]] + [""]
    for file, what, args in (("gateway-mix-bench.json", "bench model", "--preset bench"),
                             ("gateway-mix-smollm2.json", "SmolLM2-135M-Instruct q8_0, a real model", "--model smollm2-q8_0")):
        if mix := load(file):
            ours, peer = mix["runs"]["mix gateway"], mix["runs"]["mix llama-server"]
            md += [f"The 16-job mix at concurrency 8 over HTTP beside llama-server ({what}): `meshnode bench gateway "
                   f"{args} --sides 'mix gateway,mix llama-server' --rounds {len(ours)} --llama-server PATH --json "
                   f"evidence/{file}`, on {mix['build']}. Gateway + node / llama-server by round: "
                   + ", ".join(f"{a['tok_s'] / b['tok_s']:.3f}" for a, b in zip(ours, peer)) + ".", ""]
            md += [f"- {line}" for line in mix["verdict"]] + [""]
    if stacks:
        m = stacks["median"]
        md += ["Why aiohttp (`tools/http_stacks.py --rounds 3 --json evidence/http-stacks.json`, "
               f"{', '.join(f'{k} {v}' for k, v in stacks['versions'].items())}): the server process's CPU per "
               f"streamed chunk {m['aiohttp']['cpu_us_per_chunk']:.0f} us (aiohttp) vs "
               f"{m['starlette']['cpu_us_per_chunk']:.0f} us (Starlette on uvicorn), per small JSON request "
               f"{m['aiohttp']['cpu_us_per_request']:.0f} vs {m['starlette']['cpu_us_per_request']:.0f} us (medians of "
               "rounds).", ""]
    return md


def scale() -> list[str]:
    d = load("scale-bench.json")
    if not d:
        return []
    peers = d.get("peers")
    # the fake-engine figures from the newer run without peers, when there is one (it takes minutes, the peers hours)
    own_file = "scale-overhead.json" if load("scale-overhead.json") else "scale-bench.json"
    own = load(own_file)
    cmd = "--llama-server PATH " if own.get("peers") else ""
    kind = "mean" if "plan_us_mean" in next(iter(own["median"].values())) else "p50"
    md = ["## The node's own cost per tick as sessions grow", "",
          f"`meshnode bench scale --rounds {len(next(iter(own['runs'].values())))} {cmd}--json evidence/{own_file}`, "
          f"on {own['build']}: a node over the fake engine taking {own['step_ms']:g} ms a step (a fast GPU tick), N "
          "sessions decoding; and the scheduler's plan() and apply() alone in one process (their "
          f"{kind} time a tick). Medians of rounds.", "",
          "| sessions | ms a tick | the node's own ms | share of the 5 ms | plan() us | apply() us |",
          "|---|---|---|---|---|---|"]
    for n, m in own["median"].items():
        md.append(f"| {n} | {m['ms_per_tick']:.2f} | {m['node_ms_per_tick']:.2f} | {m['node_share_of_5ms']:.0%} | "
                  f"{m[f'plan_us_{kind}']:.0f} | {m[f'apply_us_{kind}']:.0f} |")
    if peers:
        md += ["", f"Beside llama-server (`meshnode bench scale --rounds {len(next(iter(d['runs'].values())))} "
               f"--llama-server PATH --json evidence/scale-bench.json`, on "
               f"{'the same build' if d['build'] == own['build'] else d['build']}; `-np N`, the same "
               "model, threads and 512 cells a session; bench model): N "
               "sessions submitted together, 32-token prompts, 64 tokens each; medians of rounds, node / llama-server.",
               "", "| sessions | tok/s | gap p50 ms | gap p99 ms | first token p50 ms | p99 |", "|---|---|---|---|---|---|"]
        for n, rounds in peers["concurrency"].items():
            a, b = _side_medians(rounds)
            md.append(f"| {n} | {a['tok_s']:.1f} / {b['tok_s']:.1f} | {a['gap_p50_ms']:.1f} / {b['gap_p50_ms']:.1f} | "
                      f"{a['gap_p99_ms']:.1f} / {b['gap_p99_ms']:.1f} | {a['ttft_p50_ms']:.0f} / {b['ttft_p50_ms']:.0f} | "
                      f"{a['ttft_p99_ms']:.0f} / {b['ttft_p99_ms']:.0f} |")
        if peers["depth"]:
            md += ["", "One session at depth (bench-long model: the bench shape, 32k trained context), node / llama-server:", "",
                   "| prompt tokens | prefill tok/s | decode ms a token |", "|---|---|---|"]
            for dep, rounds in peers["depth"].items():
                a, b = _side_medians(rounds)
                md.append(f"| {dep} | {a['prefill_tok_s']:.1f} / {b['prefill_tok_s']:.1f} | "
                          f"{a['decode_ms_per_token']:.1f} / {b['decode_ms_per_token']:.1f} |")
        if "verdicts" not in peers:  # written by a run before scale.py kept them
            from meshnode.bench.scale_peers import verdicts
            peers["verdicts"] = verdicts(peers)
        md += [""] + [f"- {line}" for line in peers["verdicts"]]
    md += ["", "KV cache types (`-ctk` / `-ctv`, bench model): the budget's bytes beside the KV buffer llama.cpp "
               "allocated (its load log, 0.01 MiB steps).", "",
           "| type | bytes a token | budget / llama.cpp's buffer | sessions of 4,096 tokens in 4 GiB |", "|---|---|---|---|"]
    for t, k in d.get("kv_types", {}).items():
        md.append(f"| {t} | {k['kv_bytes_per_token']} | {k['budget_over_llama_cpp']:.3f} | {k['sessions_of_4096_in_4gib']} |")
    return md + [""]


def memory() -> list[str]:
    d = load("memory-bench.json")
    if not d:
        return []
    a, mib = d["active"], 1 << 20
    kv_seq = a["llama_cpp_kv_per_sequence"]
    md = ["## Memory per session and per cached conversation", "",
          "`meshnode bench memory --preset bench --json evidence/memory-bench.json`, "
          f"{d['model'].rsplit('/', 1)[-1]}, on {d['build']}: "
          "RSS (psutil) of the front and the engine process. Idle after load: front "
          f"{a['idle']['front'] / mib:.1f} MiB, engine {a['idle']['engine'] / mib:.1f} MiB, beside llama.cpp's buffers: "
          f"weights {a['llama_cpp']['weights'] / mib:.1f} MiB, KV {a['llama_cpp']['kv'] / mib:.1f} MiB for "
          f"{a['n_seq_max']} sequences ({kv_seq / mib:.2f} MiB each). llama.cpp allocates and clears the whole KV "
          "buffer when the context is made (`ggml_backend_buffer_clear` in llama-kv-cache.cpp), so it is resident "
          "from the start (the KV types below: the engine's RSS follows the buffer's size): what a session adds beyond its "
          "share of that buffer is the front's and the engine's bookkeeping.", "",
          "| sessions decoding | front per session | engine per session | both, share of one sequence's KV |",
          "|---|---|---|---|"]
    for k, lv in a["levels"].items():
        both = lv["front_per_session"] + lv["engine_per_session"]
        md.append(f"| {k} | {lv['front_per_session'] / 1024:+.0f} KiB | {lv['engine_per_session'] / 1024:+.0f} KiB | "
                  f"{both / kv_seq:+.2%} |")
    md += ["", "KV types: the budget's bytes, llama.cpp's buffer and the engine's resident memory (idle, same context).",
           "", "| type | bytes a token | budget / llama.cpp's buffer | engine RSS MiB | RSS under f16 / buffer under f16 MiB "
           "| sessions of 4,096 tokens in 4 GiB |", "|---|---|---|---|---|---|"]
    for t, k in d["kv_types"].items():
        md.append(f"| {t} | {k['kv_bytes_per_token']} | {k['budget_over_llama_cpp']:.3f} | {k['engine_rss'] / mib:.1f} | "
                  f"{k['rss_saved_vs_f16'] / mib:.1f} / {k['kv_saved_vs_f16'] / mib:.1f} | {k['sessions_of_4096_in_4gib']} |")
    c = d["conversations"]
    md += ["", f"{c['users']} conversations through one node (a shared {c['system']}-token system prompt, {c['new']} user "
           f"tokens and {c['answer']} answered a turn, {c['wave']} at a time), then their second turns re-sending the history: "
           f"{c['entries_after_turn_1']} cache entries kept, each adding {c['front_per_conversation'] / 1024:+.1f} KiB "
           f"to the front and {c['engine_per_conversation'] / 1024:+.1f} KiB to the engine; {c['turn_2_hits']} of "
           f"{c['users']} second turns hit, reusing a median {c['turn_2_reused_median']:.0f} of "
           f"{c['turn_2_prompt_median']:.0f} prompt tokens (deterministic mode reuses the prompt's cells, not the "
           f"answer's), {c['evictions_total']} evictions. Lookup (PrefixCache.find, median, in process): "
           + ", ".join(f"{n} entries {us:.0f} us" for n, us in d["lookup_us"].items()) + ".", ""]
    return md


def _side_medians(rounds: list[dict]) -> tuple[dict, dict]:
    """The node's and llama-server's figures, each the median of its rounds."""
    return tuple({k: float(np.median([r[side][k] for r in rounds])) for k in rounds[0][side]}
                 for side in ("node", "llama-server"))


def abuse() -> list[str]:
    """bench abuse before and after issue 23's fixes, side by side (evidence/abuse.sh)."""
    md = []
    for preset in ("bench", "tiny"):
        after, before = load(f"abuse-{preset}.json"), load(f"abuse-{preset}-before.json")
        if not after:
            continue
        if not md:
            md = ["## Abuse: the largest valid requests of every kind against 4 streams", "",
                  "`evidence/abuse.sh` runs `python -m benchmarks abuse --rounds 3` on this tree and on the node before "
                  "issue 23 (commit 144f411, with this tree's bench laid over it: the same load). Abusers: 256 KiB "
                  "texts and chat messages of tabs (ten chat identities), 65,536-token prompts, status floods, "
                  "unknown cancels, /metrics scrapes, a client that stops reading; a one-pool node of 65,536 cells, "
                  "so the largest texts are really tokenized. Gaps are between tokens of the 4 streams; the probe "
                  "is a client of its own sending `hello` (1 token) every 0.25 s: its first token, wall ms.", ""]
        md += [f"**{preset} model** ({after.get('system_info', '').strip() or 'system info not recorded'})", "",
               "| node | round | steady p99 | abuse p99 | abuse max | max / steady p99 | probe steady p50 | "
               "probe abuse p50 | probe abuse max | probes |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, d in (("before", before), ("after", after)):
            for r in (d or {}).get("rows", []):
                md.append(f"| {name} | {r['round']} | {r['steady_p99_ms']:.1f} | {r['abuse_p99_ms']:.1f} | "
                          f"{r['abuse_max_ms']:.1f} | {r['abuse_max_ms'] / r['steady_p99_ms']:.2f}x | "
                          f"{r['probe_steady_p50_ms']:.1f} | {r['probe_abuse_p50_ms']:.1f} | "
                          f"{r['probe_abuse_max_ms']:.1f} | {r['probes']} |")
        md += [""] + [f"{name}: worst gap under abuse / steady p99 **{d['worst_ratio']:.2f}x** (target <= 2x), engine "
                      f"restarts {d['restarts']}, sessions without their done {d['lost']}; requests answered: "
                      + "; ".join(f"{k} {v['sent']}" + "".join(f", {kk} {vv}" for kk, vv in v.items() if kk != "sent")
                                  for k, v in d["requests"].items()) + "." for name, d in (("before", before),
                                                                                      ("after", after)) if d]
        md.append("")
    return md
