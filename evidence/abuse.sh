#!/usr/bin/env bash
# `python -m benchmarks abuse` before and after a change, side by side: this tree, and BEFORE (a commit) with
# this tree's benchmarks/ (and the flags in meshnode/bench/__init__.py) laid over it, so the old node meets the
# same load.
# Usage: evidence/abuse.sh [BEFORE]   (default: 144f411, the node before issue 23's fixes)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
before=${1:-144f411}
wt=$(mktemp -d)/before
git worktree add -f --detach "$wt" "$before" >/dev/null
trap 'git worktree remove --force "$wt"' EXIT
cp -r benchmarks "$wt/" && cp meshnode/bench/__init__.py "$wt/meshnode/bench/__init__.py"
for preset in bench tiny; do
    (cd "$wt" && PYTHONPATH="$wt" python -m benchmarks abuse --preset "$preset" --rounds 3 \
        --json "$root/evidence/abuse-$preset-before.json") > "evidence/abuse-$preset-before.txt" 2>&1
    python -m benchmarks abuse --preset "$preset" --rounds 3 --json "evidence/abuse-$preset.json" \
        > "evidence/abuse-$preset.txt" 2>&1
done
