#!/usr/bin/env bash
# Regenerate every measured artifact from the current tiny-trained fixture, in dependency order:
# streaming layout, prerouter heads, sample traces, the routing-regime check, and the validation
# matrix (`ssdmoe validate`: this machine's calibration, a trace per configuration, simulated vs
# measured) and, with --bench, the tiny-trained streaming benchmarks (the ~1 GB
# tiny-trained-wide benchmarks take longer: commands in reports/bench/README.md).
# Run on a quiet machine: timings in traces and benchmarks are only as good as the machine.
# Simulator-only reports (reports/paper, reports/sweeps, reports/sim) don't depend on it:
#   uv run python reports/paper/predict_paper.py; uv run ssdmoe sim sweep scenarios/grids/NAME.toml
set -euo pipefail
cd "$(dirname "$0")/.."
bench=0
[ "${1:-}" = "--bench" ] && bench=1
run() { echo "+ $*" >&2; "$@"; }
warm() { cat "$1"/experts/* > /dev/null; }

[ -f models/tiny-trained/fixture.json ] || run uv run ssdmoe fixture tiny-trained --out models/tiny-trained
run uv run ssdmoe convert models/tiny-trained models/tiny-trained-stream --force
run uv run ssdmoe train heads models/tiny-trained-stream --force    # prerouter heads, ~6 min

M=models/tiny-trained-stream
S=traces/samples
cap() { run uv run ssdmoe capture "$M" --no-progress --force "$@"; }
# decode routing is sampled by default (temperature 1, seed 0): realistic locality
warm $M; cap --out $S/tiny-trained-on-demand --max-tokens 128
cap --out $S/tiny-trained-on-demand-pc25 --max-tokens 128 --page-cache-fraction 0.25

# the routing regime: a default capture against the held-out figure, and greedy for contrast
mkdir -p runs reports/routing-regime
warm $M; cap --out runs/regime-default
cap --out runs/regime-greedy --greedy
run uv run ssdmoe trace summary runs/regime-default --json > reports/routing-regime/sampled-default.json
run uv run ssdmoe trace summary runs/regime-greedy --json > reports/routing-regime/greedy.json

# calibrates this machine (scenarios/hardware/this-machine.toml, scenarios/models/tiny-trained.toml,
# scenarios/this-machine-tiny-trained.toml), then measures and predicts the matrix
run uv run ssdmoe validate "$M" --fresh --rounds 3    # the median of 3 rotated rounds: a noisy machine

if [ $bench = 1 ]; then
    A=resident,engine-resident,resident-sync,on-demand,hot,staged,staged-oracle,staged-layer,staged-prerouter
    run uv run ssdmoe bench $M --arms $A --rounds 9 --json reports/bench/tiny-trained-warm.json
    run uv run ssdmoe bench $M --arms $A --rounds 5 --page-cache-budget 25% \
        --json reports/bench/tiny-trained-budget25.json
    run uv run ssdmoe bench $M --arms on-demand,staged-layer,staged-prerouter --rounds 5 \
        --page-cache-budget 25% --read-mbps 15 --json reports/bench/tiny-trained-budget25-15mbps.json
    run uv run python reports/policies/run.py --models tiny-trained   # cache policies, ~13 min
fi
