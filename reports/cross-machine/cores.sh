#!/usr/bin/env bash
# One core against two on this machine, paired: staged with token lead at a 1/4 page-cache
# budget (the transfer file's one-core point), each round capturing both arms, their order
# rotated. Prints decode tok/s, CPU per step (the process, the main thread) and, from GNU time,
# the capture's system time and context switches; writes cores.json. Needs root (cpuset) and
# models/tiny-trained-stream with prerouter heads. Usage: bash reports/cross-machine/cores.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
model=models/tiny-trained-stream
for ((r = 0; r < rounds; r++)); do
    arms=("two" "one"); ((r % 2)) && arms=("one" "two")
    for arm in "${arms[@]}"; do
        flags=(); [ "$arm" = one ] && flags=(--cpus 1)
        /usr/bin/time -v -o "$tmp/$arm.r$r.time" uv run ssdmoe capture "$model" \
            --out "$tmp/$arm.r$r" --force --no-progress --no-verify --max-tokens 96 \
            --prompts reports/cross-machine/b-validation/prompts.jsonl --preset staged \
            --prerouter "$model/prerouter" --page-cache-fraction 0.25 "${flags[@]}" > /dev/null 2>&1
        uv run ssdmoe trace summary "$tmp/$arm.r$r" --json > "$tmp/$arm.r$r.json" 2> /dev/null
    done
done
uv run python - "$tmp" "$rounds" <<'PY'
import json, re, sys
from pathlib import Path
tmp, rounds = Path(sys.argv[1]), int(sys.argv[2])
rows = []
for r in range(rounds):
    for arm in ("two", "one"):
        s = json.loads((tmp / f"{arm}.r{r}.json").read_text())
        t = (tmp / f"{arm}.r{r}.time").read_text()
        grab = lambda label: float(re.search(rf"{label}: ([\d.]+)", t).group(1))
        rows.append({"round": r, "cores": 1 if arm == "one" else 2,
                     "decode_tok_s": round(s["decode_tok_s"], 2),
                     "cpu_ms_per_step": round(s["cpu_ms_per_step"], 2),
                     "main_cpu_ms_per_step": round(s["main_cpu_ms_per_step"], 2),
                     "system_s": grab("System time \\(seconds\\)"),
                     "user_s": grab("User time \\(seconds\\)"),
                     "voluntary_switches": int(grab("Voluntary context switches")),
                     "involuntary_switches": int(grab("Involuntary context switches"))})
print("| round | cores | decode tok/s | CPU ms/step | main-thread CPU ms/step | system s | user s | voluntary / involuntary switches |")
print("|---|---|---|---|---|---|---|---|")
for x in rows:
    print(f"| {x['round']} | {x['cores']} | {x['decode_tok_s']} | {x['cpu_ms_per_step']} | {x['main_cpu_ms_per_step']} | {x['system_s']} | {x['user_s']} | {x['voluntary_switches']} / {x['involuntary_switches']} |")
out = Path("reports/cross-machine/cores.json")
out.write_text(json.dumps({"command": "bash reports/cross-machine/cores.sh " + str(rounds), "rows": rows}, indent=1) + "\n")
print(f"wrote {out}")
PY
