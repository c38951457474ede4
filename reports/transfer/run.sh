#!/usr/bin/env bash
# Emulated machines, measured and then simulated. Each point is one `ssdmoe capture` on a
# machine the kernel's control groups make (engine.machine_limits), in rounds whose order
# rotates; reports/transfer/summarize.py then replays every trace with `ssdmoe sim compare`
# (the committed profiles, nothing refitted) and writes README.md, transfer.json and the PNGs.
#   memory   tiny-trained-wide, on-demand and staged with token lead, --mem-limit from "every
#            expert fits" down to below one step's working set (no page-cache budget: the
#            kernel reclaims within the limit)
#   cores    tiny-trained at a 1/4 page-cache budget, on-demand and staged with token lead, on
#            2 cores, --cpus 1 and --cpu-quota 0.5
#   hot      tiny-trained-wide, the hot path under a 1000 MiB limit, its LRU from 32 to 384 MiB:
#            the app cache takes from the page cache
# Needs root, models/tiny-trained-stream and models/tiny-trained-wide-stream with prerouter
# heads (reports/io/run.sh prepares both). Usage: [CURVES="memory cores hot"] [OUT=DIR] bash
# reports/transfer/run.sh [ROUNDS]   (OUT: where traces/ and the summary go; default
# reports/transfer, the committed run; another machine's run goes in a folder of its own)
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-2}
where=${OUT:-reports/transfer}
out=$where/traces
prompts=$(mktemp --suffix=.jsonl)
# two short prompts (their first 64 characters): decode is what is measured, and a long
# prompt's prefill on the wide model takes longer than its decode
head -n 2 traces/prompts/default.jsonl | python3 -c '
import json, sys
for line in sys.stdin:
    print(json.dumps({"prompt": json.loads(line)["prompt"][:64]}))' > "$prompts"
trap 'rm -f "$prompts"' EXIT
for m in tiny-trained-stream tiny-trained-wide-stream; do
    [ -f "models/$m/prerouter/prerouter.json" ] || { echo "run.sh: models/$m with prerouter heads needed (bash reports/io/run.sh)"; exit 2; }
done
wide=models/tiny-trained-wide-stream
tiny=models/tiny-trained-stream
curves=${CURVES:-memory cores hot}
points=()
[[ " $curves " == *" memory "* ]] && for mem in 1400M 900M 600M 450M 350M; do
    points+=("memory|$wide|on-demand-$mem|--preset on-demand --mem-limit $mem")
    points+=("memory|$wide|staged-token-$mem|--preset staged --prerouter $wide/prerouter --mem-limit $mem")
done
[[ " $curves " == *" cores "* ]] && for machine in base "cpus1|--cpus 1" "quota0.5|--cpu-quota 0.5"; do
    tag=${machine%%|*}; flags=""; [ "$tag" != base ] && flags=${machine#*|}
    points+=("cores|$tiny|on-demand-$tag|--preset on-demand --page-cache-fraction 0.25 $flags")
    points+=("cores|$tiny|staged-token-$tag|--preset staged --prerouter $tiny/prerouter --page-cache-fraction 0.25 $flags")
done
[[ " $curves " == *" hot "* ]] && for hot in 32 128 256 384; do
    points+=("hot|$wide|hot-${hot}M|--preset hot --hot-mb $hot --mem-limit 1000M")
done
n=${#points[@]}
for ((r = 0; r < rounds; r++)); do
    for ((i = 0; i < n; i++)); do
        p=${points[$(((i + r * 5) % n))]}  # rotate the order from round to round
        IFS='|' read -r curve model name flags <<< "$p"
        dir="$out/$curve/$name.r$r"
        echo "[round $((r + 1))/$rounds] $curve $name"
        # shellcheck disable=SC2086
        uv run ssdmoe capture "$model" --out "$dir" --force --no-progress --prompts "$prompts" \
            --max-tokens 32 --no-verify $flags || echo "  capture failed: $dir"
    done
done
uv run python reports/transfer/summarize.py "$where"
