#!/usr/bin/env bash
# Regenerate every measured artifact from the current tiny-trained fixture, in dependency order:
# streaming layouts, prerouter heads, this machine's calibrated profile, sample and validation traces, the
# simulator-vs-measured validation report and (with --bench) the tiny-trained streaming benchmarks
# (the ~1 GB tiny-trained-wide benchmarks take longer: commands in reports/bench/README.md).
# Run on a quiet machine: timings in traces and benchmarks are only as good as the machine.
# Simulator-only reports (reports/paper, reports/sweeps, reports/sim) don't depend on it:
#   uv run python reports/paper/generate.py; uv run ssdmoe sim sweep scenarios/grids/NAME.toml
set -euo pipefail
cd "$(dirname "$0")/.."
bench=0
[ "${1:-}" = "--bench" ] && bench=1
run() { echo "+ $*" >&2; "$@"; }
warm() { cat "$1"/experts/* > /dev/null; }

[ -f models/tiny-trained/fixture.json ] || run uv run ssdmoe fixture tiny-trained --out models/tiny-trained
run uv run ssdmoe convert models/tiny-trained models/tiny-trained-stream --force
run uv run ssdmoe train heads models/tiny-trained-stream --force    # prerouter heads, ~5 min
run uv run ssdmoe calibrate --out scenarios/hardware/this-machine.toml \
    --model-out scenarios/models/tiny-trained.toml --scenario-out scenarios/this-machine-tiny-trained.toml

M=models/tiny-trained-stream
S=traces/samples
V=reports/validation/traces
cap() { run uv run ssdmoe capture "$M" --no-progress --force "$@"; }
warm $M; cap --out $S/tiny-trained-on-demand --max-tokens 128
cap --out $S/tiny-trained-on-demand-pc25 --max-tokens 128 --page-cache-fraction 0.25
warm $M; cap --out $S/tiny-trained-on-demand-t08 --max-tokens 128 --temp 0.8 --seed 0
warm $M; cap --out $V/tiny-trained-hot --max-tokens 64 --preset hot
cap --out $V/tiny-trained-hot-pc25 --max-tokens 64 --preset hot --page-cache-fraction 0.25
warm $M; cap --out $V/tiny-trained-staged --max-tokens 64 --preset staged
cap --out $V/tiny-trained-on-demand-odirect --max-tokens 64 --o-direct
warm $M; cap --out $V/tiny-trained-staged-prerouter --max-tokens 64 --preset staged --prerouter $M/prerouter
cap --out $V/tiny-trained-staged-prerouter-pc25 --max-tokens 64 --preset staged --prerouter $M/prerouter \
    --page-cache-fraction 0.25
run uv run python reports/validation/generate.py

if [ $bench = 1 ]; then
    A=resident,engine-resident,resident-sync,on-demand,hot,staged,staged-oracle,staged-prerouter
    run uv run ssdmoe bench $M --arms $A --rounds 9 --json reports/bench/tiny-trained-warm.json
    run uv run ssdmoe bench $M --arms $A --rounds 5 --page-cache-budget 25% \
        --json reports/bench/tiny-trained-budget25.json
fi
