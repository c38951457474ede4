#!/usr/bin/env bash
# The whole recovery pipeline on a converted model, each phase timed: prerouter heads (phase 1,
# skipped when MODEL has them for this K), the LoRA on the student path (phase 2, sft), its
# on-policy distillation (phase 3), then `ssdmoe eval`. Usage: scripts/lora_pipeline.sh MODEL [K]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: scripts/lora_pipeline.sh MODEL [K]}
k=${2:-}
opt=()
heads="$model/prerouter"
if [ -n "$k" ]; then
    opt=(--top-k "$k")
    native=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['top_k'])" "$model/manifest.json")
    [ "$k" != "$native" ] && heads="$model/prerouter-k$k"
fi
log=$(mktemp)
t0=$(date +%s)
phase() {  # phase NAME COMMAND...: run it, note its wall time
    local s=$(date +%s)
    "${@:2}"
    echo "$1 $(( $(date +%s) - s ))" >> "$log"
}
if [ ! -f "$heads/prerouter.json" ]; then
    phase heads uv run ssdmoe train heads "$model" "${opt[@]}"
fi
phase sft uv run ssdmoe train sft "$model" --restart "${opt[@]}"
phase distill uv run ssdmoe train distill "$model" --restart "${opt[@]}"
echo "pipeline $(( $(date +%s) - t0 ))" >> "$log"
phase eval uv run ssdmoe eval "$model" "${opt[@]}"
echo "wall seconds per phase:"; cat "$log"
# the same figures as JSON: reports/quality/pipeline-<model>-k<K>.json
python3 - "$log" "$model" "${k:-native}" "$*" <<'PY'
import hashlib, json, sys, time
from pathlib import Path
log, model, k, args = sys.argv[1:]
phases = dict((n, int(s)) for n, s in (line.split() for line in Path(log).read_text().split("\n") if line))
sha = hashlib.sha256((Path(model) / "manifest.json").read_bytes()).hexdigest()
out = Path("reports/quality") / f"pipeline-{Path(model).name}-k{k}.json"
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps({"command": f"bash scripts/lora_pipeline.sh {args}", "date": time.strftime("%Y-%m-%d"),
                           "manifest_sha256": sha, "wall_seconds": phases}, indent=1) + "\n")
print(f"wrote {out}")
PY
