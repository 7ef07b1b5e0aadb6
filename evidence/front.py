"""Evidence sections about the front: its cost per tick before and after the tick driver and output stage
(issue 46), and two priorities under overload (issue 47)."""
from __future__ import annotations

import statistics

from sections import load


def overhead_before_after() -> list[str]:
    """`bench overhead` on the real model at the commit before issue 46's restructuring and after it."""
    md = []
    for c in (1, 8):
        before = load(f"overhead-bench-smollm2-before-front-c{c}.json")
        after = load(f"overhead-bench-smollm2-c{c}.json")
        if not (before and after):
            continue
        if not md:
            md = ["## The front's cost per tick, before and after the tick driver and output stage (issue 46)", "",
                  "`meshnode bench overhead --model smollm2-q8_0 --levels 1,8`, SmolLM2-135M-Instruct q8_0 (a real "
                  "model), 16 jobs, 6 rounds each: before = commit 3d902aa (the same command from a worktree of it, "
                  "`PYTHONPATH` set to it; files `overhead-bench-smollm2-before-front-c*.json`), after = commit 7a84cb5 "
                  "(`overhead-bench-smollm2-c*.json`; the commits after it touched the priority policy, a stalled "
                  "client's case in the output stage and docs). Two runs of a noisy shared machine, not side by side: the "
                  "per-tick figures are the ones to compare.", "",
                  "| concurrency | side | node / in-process | engine wait p50 (median of rounds) us | "
                  "front + IPC us per tick, node (median of rounds) | lockstep engine wait p50 us |",
                  "|---|---|---|---|---|---|"]
        for name, o in (("before", before), ("after", after)):
            per_tick = statistics.median(r["non_engine_us_per_tick_node"] for r in o["runs"])
            md.append(f"| {c} | {name} | {o['ratio_all_runs']:.3f} | {o['engine_wait_us_median']:.0f} | "
                      f"{per_tick:.0f} | {o['lockstep_wait_us_median']:.0f} |")
    if md:
        md += ["", f"Builds: before {before.get('llama_build', '?')}; after {after.get('llama_build', '?')}.", ""]
    return md


def priority() -> list[str]:
    p = load("priority-bench-smollm2.json")
    if not p:
        return []
    md = ["## Priorities under overload (issue 47)", "",
          "`python -m benchmarks priority --model smollm2-q8_0 --rounds 2 --json evidence/priority-bench-smollm2.json` "
          f"({p['build']}). SmolLM2-135M-Instruct q8_0, {p['slots']} slots, a queue of {p['queue']}; the low class "
          f"keeps the node overloaded ({p['low_tokens']} new tokens each), a high-class request ({p['high_tokens']} "
          f"new tokens) every {p['high_every_s']} s; first-token times as the client sees them, ms.", "",
          "| policy | round | high p50 | high p90 | idle high p50 | low p50 | low refused | low displaced | "
          "high refused (sent again) | low preempted |", "|---|---|---|---|---|---|---|---|---|---|"]
    q = lambda xs, f: statistics.quantiles(xs, n=10)[8] if f == 90 and len(xs) > 1 else statistics.median(xs)  # noqa
    for policy, runs in p["runs"].items():
        for i, r in enumerate(runs, 1):
            md.append(f"| {policy} | {i} | {q(r['high_ttft_ms'], 50):.0f} | {q(r['high_ttft_ms'], 90):.0f} | "
                      f"{q(r['idle_high_ttft_ms'], 50):.0f} | {q(r['low_ttft_ms'], 50):.0f} | {r['low_refused']} | "
                      f"{r['low_displaced']} | {r['high_refused']} | {r.get('preemptions', 'n/a')} |")
    return md + ["", *[f"- {v}" for v in p["verdict"]], "",
                 "Under `priority` a high request that finds every slot busy preempts the worst low session "
                 "(recompute: it goes back to the queue with its tokens; the `low preempted` column); with a slot "
                 "kept for it (`reserved`) it starts without preempting. Either way what it still waits for is the "
                 "ticks already planned when it arrives (the one the engine runs and the one planned behind it, "
                 "often holding a low request's 24-token prefill, a hundred ms or more on this CPU where a row "
                 "costs about what a decode does) and its own prefill beside the low class's decode rows; an idle "
                 "node has neither. The run before preemption (commit eca92f1, same command): priority 5.71x, "
                 "reserved 1.82x, fcfs 41.67x.", ""]


# why each of llama-server's passes the gateway does not pass: fields and behaviours of llama.cpp's own, or
# settings the node has no equivalent of (issue 53 asks for this list)
LLAMA_ONLY = {
    "test_server_model_aliases_and_tags": "`aliases` and `tags` in /v1/models: llama-server's own fields (the node "
                                          "names its model with `served_model_name`)",
    "test_server_multiple_addresses": "`--host 127.0.0.1,::1`: llama-server binds several addresses; the gateway "
                                      "listens on one HOST:PORT",
    "test_chat_completion_with_timings_per_token": "`timings` in each chunk: llama-server's own field",
    "test_context_size_exceeded": "error type `exceed_context_size_error` with `n_prompt_tokens` and `n_ctx`: "
                                  "llama-server's own; the gateway answers 400 too, with OpenAI's error body",
    "test_context_size_exceeded_stream": "as test_context_size_exceeded, streamed",
    "test_return_progress": "`prompt_progress` chunks: llama-server's own",
    "test_verbose_debug": "`__verbose` debug output: llama-server's own",
    "test_responses_stream_with_llama_telemetry": "`timings` in the Responses stream: llama-server's own",
    "test_embedding_pooling_none_oai": "`--pooling none` (per-token vectors): the node pools mean, cls or last "
                                       "and refuses `none` at start",
    "test_completion_with_response_format": "a sampled answer checked against a pattern: the request names no seed, "
                                            "and llama-server's preset starts it with `--seed 42 --temp 0.8` as "
                                            "server-wide defaults, which the node does not take (it draws a random "
                                            "seed at OpenAI's temperature 1): the same test passed in the two "
                                            "earlier runs today",
    "test_metrics_disabled": "/metrics answered 501 without `--metrics`: the gateway always serves it (routers "
                             "scrape it), by design",
}


def llamatests() -> list[str]:
    t = load("llamatests-smollm2.json")
    if not t:
        return []
    base, passed = t["llama_server_passes"], set(t["meshnode_passes"])
    md = ["## llama.cpp's own server tests against the gateway (issue 53)", "",
          "`python -m benchmarks llamatests --model smollm2-q8_0 --llama-server PATH --json "
          f"evidence/llamatests-smollm2.json` ({t['build']}): the tests of tools/server/tests in the sdist "
          f"llama-server was built from ({', '.join(t['files'])}), model {t['model'].rsplit('/', 1)[-1]}, "
          "against llama-server and then, through benchmarks/llamashim.py, against `meshnode serve --http`, the "
          "tests of the OpenAI surface llama-server passes (those that call only OpenAI's paths; llama.cpp's own "
          f"endpoints are left out). llama-server passes **{len(base)}**; meshnode **{len(passed)}** of them "
          f"({t['seconds']['llama-server']:.0f} s and {t['seconds']['meshnode']:.0f} s).", "",
          "| test meshnode does not pass | the line that failed | why |", "|---|---|---|"]
    ours = t["results"]["meshnode"]
    for name in base:
        if name not in passed:
            short = name.split("::")[1].split("[")[0]
            md.append(f"| `{name.split('/')[-1]}` | {ours.get(name, {}).get('why', 'not run')} | "
                      f"{LLAMA_ONLY.get(short, '**not explained: a gap to close**')} |")
    return md + [""]


def samples() -> list[str]:
    s = load("samples.json")
    if not s:
        return []
    md = ["## A tick's sampled ids: in the answer or through the arena (issue 54)", "",
          "`python -m benchmarks samples --rounds 5 --json evidence/samples.json`: both ways timed in one process "
          f"(engine side and front side), {s['iters']} ticks a round, median of {s['rounds']} rounds, us a tick "
          f"({s['build']}).", "",
          "| decode rows | arena us | in the msgpack answer us | ratio |", "|---|---|---|---|"]
    md += [f"| {rows} | {f['arena_us']:.1f} | {f['message_us']:.1f} | {f['message_us'] / f['arena_us']:.2f}x |"
           for rows, f in s["rows"].items()]
    return md + ["", "The ids now travel in the answer; the arena keeps the prompt tokens and the heartbeat.", ""]


def embed() -> list[str]:
    e = load("embed-bench-smollm2.json")
    if not e:
        return []
    return ["## /v1/embeddings against llama-server's (issue 53)", "",
            "`python -m benchmarks embed --model smollm2-q8_0 --llama-server PATH --json "
            f"evidence/embed-bench-smollm2.json` ({e['build']}): SmolLM2-135M-Instruct q8_0, mean pooling, the spec "
            "bench's eight chat questions and its code file in one request, through the node's gateway and through "
            "llama-server `--embedding --pooling mean` on one slot (on 8 slots this build's llama-server answers a "
            "request of several inputs with vectors mixed across them, cosine 0.62-0.96 to its own one-slot "
            "answers; on 9 it aborts at start).", "", f"- {e['verdict']}", ""]


def moves() -> list[str]:
    m = load("moves-bench-smollm2.json")
    if not m:
        return []
    md = ["## A session moved with its KV vs prefilled again (issue 56)", "",
          "`python -m benchmarks moves --model smollm2-q8_0 --threads 2 --rounds 3 --json "
          f"evidence/moves-bench-smollm2.json` ({m['build']}): SmolLM2-135M-Instruct q8_0, two nodes on this "
          "machine, f16 KV; a session of each context length generates 4 tokens on node A and is exported; its "
          "state goes to node B with its KV, and (another prompt of that length) without it. Medians of "
          f"{m['rounds']} rounds; 'move' is the export on A (request to last KV byte) plus the import on B "
          "(request to its first token there).", "",
          "| context | KV MiB | export ms | import with KV ms | move ms | import prefilling again ms | "
          "re-prefill / move |", "|---|---|---|---|---|---|---|"]
    for n, row in m["lengths"].items():
        x = row["median"]
        move = x["export_s"] + x["import_kv_s"]
        md.append(f"| {n} | {x['kv_bytes'] / 2**20:.1f} | {x['export_s'] * 1e3:.0f} | {x['import_kv_s'] * 1e3:.0f} | "
                  f"{move * 1e3:.0f} | {x['import_prefill_s'] * 1e3:.0f} | {x['import_prefill_s'] / move:.2f}x |")
    return md + [""]
