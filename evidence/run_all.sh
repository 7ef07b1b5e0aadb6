#!/usr/bin/env bash
# Re-run every benchmark behind evidence/README.md (about an hour on 2 cores), then re-render it.
# MESHNODE_NO_OPENMP_PYTHON=/path/to/python (a venv with llama-cpp-python built as the README's
# "Small CPU-only nodes" says) adds the overhead bench on that build.
# MESHNODE_LLAMA_SERVER=/path/to/llama-server (README, "Benchmarks") adds the peer to chat and burst.
set -euo pipefail
cd "$(dirname "$0")/.."
# a sweep exits 1 when it finds a job whose tokens differ across concurrency levels; that verdict is
# recorded in its files and in the README, and must not stop the other benchmarks from running
python -m meshnode sweep --json evidence/sweep-tiny.json > evidence/sweep-tiny.txt 2>/dev/null || true
python -m meshnode sweep --preset bench --jobs 16 --prompt-len 4,16,32,64,100 --new-tokens 32 --no-deterministic --json evidence/sweep-bench.json > evidence/sweep-bench.txt 2>/dev/null || true
python -m benchmarks engine --preset bench --json evidence/engine-bench.json > evidence/engine-bench.txt 2>&1
python -m meshnode bench overhead --preset bench --json evidence/overhead-bench.json > evidence/overhead-bench.txt 2>&1
if [ -n "${MESHNODE_NO_OPENMP_PYTHON:-}" ]; then  # a python whose llama-cpp-python was built without OpenMP
    "$MESHNODE_NO_OPENMP_PYTHON" -m meshnode bench overhead --preset bench --json evidence/overhead-bench-no-openmp.json > evidence/overhead-bench-no-openmp.txt 2>&1
fi
python -m meshnode bench peers --preset bench --json evidence/peers-bench.json > evidence/peers-bench.txt 2>&1
PEER=${MESHNODE_LLAMA_SERVER:+--llama-server $MESHNODE_LLAMA_SERVER}
python -m meshnode bench burst --preset bench --rounds 3 $PEER --json evidence/burst-bench.json > evidence/burst-bench.txt 2>&1
if [ -n "$PEER" ]; then  # the same on the real model (its copy made at first use): the trade on its costs
    python -m meshnode bench burst --model smollm2-q8_0 --rounds 3 $PEER --json evidence/burst-bench-smollm2.json > evidence/burst-bench-smollm2.txt 2>&1
fi
if [ -n "$PEER" ]; then  # the peer is the point of this one
    for preset in bench bench-32k; do
        python -m benchmarks structured --preset $preset --rounds 3 $PEER --json evidence/structured-$preset.json > evidence/structured-$preset.txt 2>&1
    done
fi
python -m meshnode bench gateway --preset bench --rounds 3 $PEER --json evidence/gateway-bench.json > evidence/gateway-bench.txt 2>&1
python -m meshnode bench gateway --preset bench --rounds 7 --sides "c1 zmq,c1 http,c8 zmq,c8 http" --tokens 256 --json evidence/gateway-pairs.json > evidence/gateway-pairs.txt 2>&1
python -m meshnode bench gateway --preset bench --threads 1 --rounds 5 --sides "c1 zmq,c1 http,c8 zmq,c8 http" --tokens 256 --json evidence/gateway-pairs-threads1.json > evidence/gateway-pairs-threads1.txt 2>&1
python -m meshnode bench scale --preset bench --rounds 2 $PEER --json evidence/scale-bench.json > evidence/scale-bench.txt 2>&1
python -m meshnode bench scale --preset bench --rounds 3 --json evidence/scale-overhead.json > evidence/scale-overhead.txt 2>&1
python -m meshnode bench memory --preset bench --json evidence/memory-bench.json > evidence/memory-bench.txt 2>&1
python -m benchmarks chat --preset bench --rounds 3 $PEER --json evidence/chat-bench.json > evidence/chat-bench.txt 2>&1
python -m benchmarks ticks --preset bench --rounds 5 --json evidence/tick-shapes.json > evidence/tick-shapes.txt 2>&1
python -m benchmarks sampling --preset bench --rounds 3 --json evidence/sampling-bench.json > evidence/sampling-bench.txt 2>&1
python -m benchmarks layout --preset bench --rounds 3 --json evidence/layout-bench.json > evidence/layout-bench.txt 2>&1
for i in 1 2 3 4 5; do  # default settings (deterministic mode where it holds): no job may differ across levels
    python -m meshnode sweep --preset bench --jobs 16 --prompt-len 4,16,32,64,100 --new-tokens 32 --json evidence/sweep-bench-default-$i.json > evidence/sweep-bench-default-$i.txt 2>&1 || true
done
python -m benchmarks restart --preset tiny --json evidence/restart-tiny.json > evidence/restart-tiny.txt 2>&1
python -m benchmarks restart --preset bench --json evidence/restart-bench.json > evidence/restart-bench.txt 2>&1
python -m benchmarks ipc > evidence/ipc.txt 2>&1
python -m benchmarks rpc --preset bench --rounds 3 --json evidence/rpc-bench.json > evidence/rpc-bench.txt 2>&1
bash evidence/abuse.sh  # before and after issue 23, both presets
python -m benchmarks soak --preset tiny --minutes 2 --kill-every 10 --json evidence/soak-tiny.json > evidence/soak-tiny.txt 2>&1
python evidence/render.py
