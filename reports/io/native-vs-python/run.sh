#!/usr/bin/env bash
# Native reader threads against Python ones, on the same engine: every `ssdmoe bench` below
# runs each streaming arm with native readers and again, as ARM@before, with Python readers
# (--before-python-reads), in the same rounds, arm order rotated, paired within rounds; 2
# reads in flight in every arm (4 in the wide model's quarter-r4 runs). Then reports/io/summarize.py writes README.md's tables and
# io.json here (or in OUT), "before" meaning Python readers, with the device latency of
# HARDWARE (the machine it ran on). Needs the models reports/io/run.sh prepares and root for
# the read throttle.
# Usage: [HARDWARE=<profile.toml>] [OUT=<folder>] bash reports/io/native-vs-python/run.sh [model]...
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-reports/io/native-vs-python}
hardware=${HARDWARE:-scenarios/hardware/this-machine.toml}
models=${*:-tiny-trained tiny-trained-wide}
mkdir -p "$out"
bench() {  # $1: model name, $2: regime tag, rest: bench options
    local name=$1 tag=$2
    shift 2
    uv run ssdmoe bench "models/$name-stream" --native-reads --before-python-reads \
        --arms resident,on-demand,staged,staged-prerouter --readers 2 \
        --json "$out/$name-$tag.json" "$@"  # a later --readers wins
}
for name in $models; do
    if [ "$name" = tiny-trained-wide ]; then
        bench "$name" warm --rounds 3 --max-tokens 24 --num-prompts 1
        bench "$name" quarter --rounds 3 --max-tokens 24 --num-prompts 1 --page-cache-budget 25%
        bench "$name" quarter-r4 --rounds 3 --max-tokens 24 --num-prompts 1 \
            --page-cache-budget 25% --readers 4
    else
        bench "$name" warm --rounds 5 --max-tokens 48 --num-prompts 2
        bench "$name" quarter --rounds 5 --max-tokens 48 --num-prompts 2 --page-cache-budget 25%
        bench "$name" quarter-15mbps --rounds 2 --max-tokens 48 --num-prompts 2 \
            --page-cache-budget 25% --read-mbps 15
    fi
done
uv run python reports/io/summarize.py "$out" --hardware "$hardware"
