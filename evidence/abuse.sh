#!/usr/bin/env bash
# `meshnode bench abuse` before and after a change, side by side: this tree, and BEFORE (a commit) with
# this tree's meshnode/bench/abuse.py laid over it, so the old node meets the same load.
# Usage: evidence/abuse.sh [BEFORE]   (default: 144f411, the node before issue 23's fixes)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
before=${1:-144f411}
wt=$(mktemp -d)/before
git worktree add -f --detach "$wt" "$before" >/dev/null
trap 'git worktree remove --force "$wt"' EXIT
cp meshnode/bench/abuse.py "$wt/meshnode/bench/abuse.py"
for preset in bench tiny; do
    (cd "$wt" && PYTHONPATH="$wt" python -m meshnode bench abuse --preset "$preset" --rounds 3 \
        --json "$root/evidence/abuse-$preset-before.json") > "evidence/abuse-$preset-before.txt" 2>&1
    python -m meshnode bench abuse --preset "$preset" --rounds 3 --json "evidence/abuse-$preset.json" \
        > "evidence/abuse-$preset.txt" 2>&1
done
