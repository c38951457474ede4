#!/usr/bin/env bash
# One core against two on this machine, paired, with the page cache holding 1/4 of the expert
# bytes and all of them: staged with token lead (the transfer file's one-core point), each round
# capturing the four arms, their order rotated. cores.py then prints decode tok/s, CPU per step
# (the process, the main thread) and, from GNU time, each capture's system time and context
# switches and the function-call IPIs the machine took during it (/proc/interrupts CAL: on x86
# Linux, how a wake-up reaches a thread on another core), replays every trace with `sim
# compare` on PROFILES (default: b-validation-6/profiles, the calibration cores.json was
# replayed on; nothing refitted) and writes cores.json. Needs root (cpuset) and
# models/tiny-trained-stream with prerouter heads.
# Usage: [PROFILES=dir] bash reports/cross-machine/cores.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
model=models/tiny-trained-stream
[ -f "$model/prerouter/prerouter.json" ] || {
    echo "cores.sh: $model with prerouter heads needed (bash reports/io/run.sh)"; exit 2; }
ipis() { awk '/^ *CAL:/ { n = 0; for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) n += $i; print n }' /proc/interrupts; }
arms=("two-quarter" "one-quarter" "two-all" "one-all")
for ((r = 0; r < rounds; r++)); do
    for ((i = 0; i < ${#arms[@]}; i++)); do
        arm=${arms[$(((i + r) % ${#arms[@]}))]}  # rotate the order from round to round
        flags=(); [[ $arm == one-* ]] && flags=(--cpus 1)
        fraction=0.25; [[ $arm == *-all ]] && fraction=1.0
        before=$(ipis)
        if ! /usr/bin/time -v -o "$tmp/$arm.r$r.time" uv run ssdmoe capture "$model" \
            --out "$tmp/$arm.r$r" --force --no-progress --no-verify --max-tokens 96 \
            --prompts reports/cross-machine/b-validation/prompts.jsonl --preset staged \
            --prerouter "$model/prerouter" --page-cache-fraction "$fraction" "${flags[@]}" \
            > /dev/null 2> "$tmp/err"; then
            echo "cores.sh: capture $arm (round $r) failed: $(tail -n 1 "$tmp/err")"
            exit 1
        fi
        if [ -n "$before" ]; then echo $(($(ipis) - before)) > "$tmp/$arm.r$r.ipis"; fi
    done
done
uv run python reports/cross-machine/cores.py "$tmp" "$rounds" \
    "${PROFILES:-reports/cross-machine/b-validation-6/profiles}"
