"""`python -m benchmarks kernels --stock BUILD --patched BUILD`: a decode row's cost, stock llama.cpp vs patches/.

Both sides are llama.cpp built from the vendored tree of the pinned llama-cpp-python (tools/build-llama-tools
builds the two: BUILD is its build folder, with bin/llama-batched-bench). Each round runs llama.cpp's own
`llama-batched-bench -npp 128 -ntg 64 -npl 1,2,4,8,16 -t THREADS -fa on -no-kvu` (a KV stream per sequence, as
the node runs) on one side then the other, the order alternating, so both are warm and share the machine's
swings. Printed: every round, the medians and their spread, decode at B sessions against one session of the same
side (issue 67's goals: 1.8x / 3x / 4x / 4.5x at 2 / 4 / 8 / 16), patched against stock, and prefill. Then
benchmarks/kernels/rowcost.cpp, built against each side, times one MUL_MAT of the model's shapes at 1-16 rows
(where a row's time goes) and checks the repacked rows bitwise against lone ones.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from meshnode.bench import model_path
from meshnode.engine.llamacpp import system_info

LEVELS = (1, 2, 4, 8, 16)
GOALS = {2: 1.8, 4: 3.0, 8: 4.0, 16: 4.5}
# SmolLM2-135M's MUL_MAT shapes (K, M): q and o, k and v, gate and up, down, the output head
SHAPES = ("576,576", "576,192", "576,1536", "1536,576", "576,49152")
ROWCOST = os.path.join(os.path.dirname(__file__), "kernels", "rowcost.cpp")


def batched(build: str, model: str, threads: int) -> tuple[dict, dict, str]:
    """One llama-batched-bench run: decode tok/s and prefill tok/s by sessions, and its system_info line."""
    out = subprocess.run([os.path.join(build, "bin", "llama-batched-bench"), "-m", model, "-c", "16384", "-b", "2048",
                          "-ub", "512", "-npp", "128", "-ntg", "64", "-npl", ",".join(map(str, LEVELS)),
                          "-t", str(threads), "-fa", "on", "-no-kvu"], capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"llama-batched-bench failed ({build}):\n{out.stderr[-2000:]}")
    tg, pp = {}, {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[2].isdigit():
            b = int(cells[2])
            pp[b], tg[b] = float(cells[5]), float(cells[7])
    return tg, pp, build_system_info(build)


def build_system_info(build: str) -> str:
    """llama_print_system_info of that build's libllama, in a process of its own (not this Python's llama.cpp)."""
    lib = os.path.join(build, "bin", "libllama.so")
    code = ("import ctypes, sys; l = ctypes.CDLL(sys.argv[1]); l.llama_print_system_info.restype = ctypes.c_char_p; "
            "print(l.llama_print_system_info().decode())")
    out = subprocess.run([sys.executable, "-c", code, lib], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or f"(unknown: {out.stderr.strip()[-200:]})"


def rowcost(build: str, threads: int, rounds: int) -> str:
    exe = os.path.join(tempfile.mkdtemp(prefix="rowcost-"), "rowcost")
    src = os.path.join(build, "..", "src") if os.path.isdir(os.path.join(build, "..", "src")) else build
    subprocess.run(["g++", "-O2", "-std=c++17", "-I", os.path.join(src, "ggml", "include"), ROWCOST,
                    "-L", os.path.join(build, "bin"), "-lggml", "-lggml-base", "-lggml-cpu",
                    f"-Wl,-rpath,{os.path.join(build, 'bin')}", "-o", exe], check=True)
    out = subprocess.run([exe, "q8_0", str(threads), str(rounds), *SHAPES], capture_output=True, text=True,
                         timeout=900)
    return out.stdout


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs)


def main(a) -> int:
    if not (a.stock and a.patched):
        print("bench kernels: give --stock BUILD and --patched BUILD (tools/build-llama-tools builds both)")
        return 2
    model, threads, rounds = model_path(a), a.threads or 2, max(a.rounds, 5)
    sides = {"stock": a.stock, "patched": a.patched}
    print(f"bench kernels: {os.path.basename(model)}, llama-batched-bench -npp 128 -ntg 64 -t {threads} -fa on "
          "-no-kvu, "
          f"{rounds} rounds alternating; this Python's llama.cpp: {system_info().strip()}")
    runs: dict[str, list] = {s: [] for s in sides}
    infos = {}
    for r in range(rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            tg, pp, infos[side] = batched(sides[side], model, threads)
            runs[side].append((tg, pp))
            print(f"  round {r + 1} {side:8s} decode tok/s " + "  ".join(f"{b}: {tg[b]:6.1f}" for b in LEVELS)
                  + f"   prefill {statistics.median(pp.values()):6.1f}")
    for side, info in infos.items():
        print(f"{side} system_info: {info}")
    med = {s: {b: statistics.median(tg[b] for tg, _ in runs[s]) for b in LEVELS} for s in sides}
    spread = {s: {b: _spread([tg[b] for tg, _ in runs[s]]) for b in LEVELS} for s in sides}
    pre = {s: statistics.median(statistics.median(pp.values()) for _, pp in runs[s]) for s in sides}
    print("\nmedians (spread), decode tok/s:")
    for s in sides:
        print(f"  {s:8s} " + "  ".join(f"{b}: {med[s][b]:6.1f} ({spread[s][b]:.0%})" for b in LEVELS)
              + f"   prefill {pre[s]:.1f}")
    met = True
    for s in sides:
        own = {b: med[s][b] / med[s][1] for b in LEVELS}
        print(f"  {s:8s} x one session: " + "  ".join(f"{b}: {own[b]:.2f}" for b in LEVELS))
    own = {b: med["patched"][b] / med["patched"][1] for b in LEVELS}
    worst = max(max(spread[s].values()) for s in sides)
    for b, goal in GOALS.items():
        ok = own[b] > goal * (1 + worst)
        met &= ok
        print(f"  goal {b} sessions >= {goal}x one: {own[b]:.2f} ({'met' if ok else 'NOT met'} beyond the spread)")
    print("  patched / stock: " + "  ".join(f"{b}: {med['patched'][b] / med['stock'][b]:.2f}" for b in LEVELS)
          + f"   prefill {pre['patched'] / pre['stock']:.2f}")
    lone_ok = med["patched"][1] >= med["stock"][1]
    print(f"  one session not slower than stock: {'yes' if lone_ok else 'NO'}")
    costs = {}
    for s, build in sides.items():
        costs[s] = rowcost(build, threads, 100)
        print(f"\none MUL_MAT of the model's shapes, {s} (ms per call, median of 100; x the one-row call):\n{costs[s]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": os.path.basename(model), "system_info": infos, "python_system_info": system_info(),
                       "rounds": {s: [{"decode": tg, "prefill": pp} for tg, pp in runs[s]] for s in sides},
                       "median": med, "spread": spread, "prefill": pre, "rowcost": costs,
                       "goals_met": met, "lone_not_slower": lone_ok}, f, indent=1)
    return 0
