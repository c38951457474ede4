#!/usr/bin/env bash
# Cheaper loads on the readers, before and after: every `ssdmoe bench` below runs each
# streaming arm with this checkout's engine and again, as ARM@before, with the engine of BASE
# (a git worktree of that commit: `--before-code`), on the same model, in the same rounds, arm
# order rotated, paired within rounds. Then reports/io/summarize.py writes README.md's tables
# and io.json here (or in OUT: another before/after of the engine), with the device latency of
# HARDWARE (the machine it ran on). Needs the models reports/io/run.sh prepares and root for
# the read throttle.
# Usage: BASE=<commit> [HARDWARE=<profile.toml>] [OUT=<folder>] \
#            bash reports/io/reader-costs/run.sh [model]...
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-reports/io/reader-costs}
base=${BASE:?set BASE to the commit to compare against}
hardware=${HARDWARE:-scenarios/hardware/this-machine.toml}
models=${*:-tiny-trained tiny-trained-wide}
tree=$(mktemp -d)/base
git worktree add --detach "$tree" "$base" >/dev/null
trap 'git worktree remove --force "$tree"' EXIT
bench() {  # $1: model name, $2: regime tag, rest: bench options
    local name=$1 tag=$2
    shift 2
    uv run ssdmoe bench "models/$name-stream" --before-code "$tree" \
        --arms resident,on-demand,staged,staged-prerouter --readers 2 \
        --json "$out/$name-$tag.json" "$@"
}
for name in $models; do
    if [ "$name" = tiny-trained-wide ]; then
        bench "$name" warm --rounds 3 --max-tokens 24 --num-prompts 1
        bench "$name" quarter --rounds 3 --max-tokens 24 --num-prompts 1 --page-cache-budget 25%
    else
        bench "$name" warm --rounds 5 --max-tokens 48 --num-prompts 2
        bench "$name" quarter --rounds 5 --max-tokens 48 --num-prompts 2 --page-cache-budget 25%
        bench "$name" quarter-15mbps --rounds 2 --max-tokens 48 --num-prompts 2 \
            --page-cache-budget 25% --read-mbps 15
    fi
done
uv run python reports/io/summarize.py "$out" --hardware "$hardware"
