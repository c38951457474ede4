#!/usr/bin/env bash
# Calibrate with this checkout and with BASE in turns, then predict the same traces from each
# calibration: the in-decode fits redone on VALIDATE_RUN's calibration configurations
# (`validate --recompare`), the transfer points of each TRANSFER_RUN re-predicted (no refit).
# Runs are full `validate` output directories (every round's traces): a fresh
# `validate --fresh --rounds 5` and `validate --transfer ... --rounds 2` of this machine.
#
#   bash reports/cross-machine/estimator_ab.sh BASE VALIDATE_RUN TRANSFER_RUN [TRANSFER_RUN...]
#   env: PAIRS (calibrations per arm, default 2), OUT (default /tmp/estimator-ab)
#
# scenarios/ is restored on exit. Writes OUT/estimator-ab.json and prints the table
# (reports/cross-machine/estimator_ab.py).
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: estimator_ab.sh BASE VALIDATE_RUN TRANSFER_RUN..." >&2; exit 2; }
for run in "${@:2}"; do  # each a validate output directory, before anything is measured
  [ -f "$run/run-settings.json" ] && [ -d "$run/traces" ] || {
    echo "estimator_ab.sh: $run: not a validate run (no run-settings.json and traces/)" >&2; exit 2; }
done
git rev-parse --verify -q "$1^{commit}" > /dev/null || {
  echo "estimator_ab.sh: $1: not a commit of this repository" >&2; exit 2; }
base=$1; matrix=$(realpath "$2"); shift 2
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
OUT=${OUT:-/tmp/estimator-ab}; PAIRS=${PAIRS:-2}
PY="$ROOT/.venv/bin/python"
SCEN=(scenarios/hardware/this-machine.toml scenarios/models/tiny-trained.toml
      scenarios/this-machine-tiny-trained.toml)
rm -rf "$OUT"; mkdir -p "$OUT/saved"
cp "${SCEN[@]}" "$OUT/saved/"
restore() { cp "$OUT/saved/this-machine.toml" "${SCEN[0]}"; cp "$OUT/saved/tiny-trained.toml" "${SCEN[1]}"
            cp "$OUT/saved/this-machine-tiny-trained.toml" "${SCEN[2]}"
            git worktree remove --force "$OUT/base" 2>/dev/null || true; }
trap restore EXIT
git worktree add -f --detach "$OUT/base" "$base" -q
ssdmoe_in() { (cd "$1" && shift && "$PY" -c \
  "import sys; from ssdmoe_cli.main import main; sys.argv[0] = 'ssdmoe'; main()" "$@"); }
rounds_of() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['rounds'])" "$1/run-settings.json"; }
cals=()
for i in $(seq 1 "$PAIRS"); do
  arms=(new old); [ $((i % 2)) -eq 0 ] && arms=(old new)  # rotate which goes first
  for arm in "${arms[@]}"; do
    c=$OUT/cal-$arm-$i; mkdir -p "$c"; dir=$ROOT; [ "$arm" = old ] && dir=$OUT/base
    echo "calibrate $arm $i ($(date -u +%H:%M:%S))" >&2
    ssdmoe_in "$dir" calibrate --out "$c/hardware.toml" --model "$ROOT/models/tiny-trained-stream" \
      --model-out "$c/model.toml" --scenario-out "$c/scenario.toml" --json "$c/calibration.json" \
      > "$c/log" 2>&1
    cals+=("$c")
  done
done
for c in "${cals[@]}"; do
  cp "$c/hardware.toml" "${SCEN[0]}"; cp "$c/model.toml" "${SCEN[1]}"; cp "$c/scenario.toml" "${SCEN[2]}"
  rm -rf "$c/matrix"; cp -r "$matrix" "$c/matrix"; rm -f "$c/matrix/calibration-fit.json"
  .venv/bin/ssdmoe validate models/tiny-trained-stream --recompare --rounds "$(rounds_of "$matrix")" \
    --out "$c/matrix" > "$c/matrix.log" 2>&1
  for t in "$@"; do
    d=$c/transfer-$(basename "$t"); rm -rf "$d"; cp -r "$t" "$d"; rm -f "$d/transfer.json" "$d/README.md"
    machines=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['machines'])" "$t/run-settings.json")
    .venv/bin/ssdmoe validate models/tiny-trained-stream --transfer "$machines" --no-calibrate \
      --rounds "$(rounds_of "$t")" --out "$d" > "$d.log" 2>&1
  done
done
"$PY" reports/cross-machine/estimator_ab.py "$OUT" "$@"
