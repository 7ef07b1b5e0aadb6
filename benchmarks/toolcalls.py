"""`python -m benchmarks toolcalls [--model smollm2]`: tool calls within a small budget on a real model, as a new
user meets them (issue 53): `tool_choice: "required"` at temperature 1 and `max_tokens` 64, ten seeded answers
each for one function, two functions, and two with `parallel_tool_calls: false`, through the node's gateway with
the official `openai` package: how many answers hold a whole call whose arguments validate against their
function's schema, and each answer's finish reason and number of calls."""
from __future__ import annotations

import json
import os

from ipc.transport import free_tcp_port
from meshnode.bench import llama_build, model_path
from meshnode.dev.nodeproc import NodeProcess
from meshnode.dev.toolsets import ASK, SCHEMAS, TIME, WEATHER

CASES = (("one function", [WEATHER], {}), ("two functions", [WEATHER, TIME], {}),
         ("two, parallel_tool_calls false", [WEATHER, TIME], {"parallel_tool_calls": False}))


def main(a) -> int:
    import jsonschema
    import openai

    from benchmarks.embed import up

    a.model = a.model or "smollm2"  # the packaged model the issue measured
    path = model_path(a)
    print(f"bench toolcalls: {os.path.basename(path)}, required, temperature 1, max_tokens 64, seeds 0-9; "
          f"{llama_build()}", flush=True)
    port, out = free_tcp_port(), {}
    with NodeProcess(path, "--http", f"127.0.0.1:{port}", "--max-active", "4", "--log-level", "WARNING"):
        up(f"http://127.0.0.1:{port}")
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        for name, fns, kw in CASES:
            answers = []
            for seed in range(10):
                c = oa.chat.completions.create(model="m", messages=ASK, tools=fns, tool_choice="required",
                                               temperature=1.0, seed=seed, max_tokens=64, **kw).choices[0]
                calls = c.message.tool_calls or []
                good = bool(calls) and all(_valid(t, jsonschema) for t in calls)
                answers.append({"finish": c.finish_reason, "calls": len(calls), "valid": good})
            n = sum(x["valid"] for x in answers)
            out[name] = answers
            print(f"  {name}: {n}/10 answers hold whole, valid calls; " + ", ".join(
                f"{x['finish']}/{x['calls']}" for x in answers))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "build": llama_build(), "cases": out}, f, indent=1)
    return 0


def _valid(call, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
