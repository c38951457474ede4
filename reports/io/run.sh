#!/usr/bin/env bash
# One read per expert, before and after: every `ssdmoe bench` below runs each streaming arm on
# the bundled layout (one vectored read per expert) and again on the same model converted in
# the stacked version-1 layout (one read per tensor slice) as ARM@before, in the same rounds,
# arm order rotated, paired within rounds. Then reports/io/summarize.py writes README.md and
# io.json from the bench JSONs. Needs models/tiny-trained (ssdmoe fixture tiny-trained) and
# root for the read throttle. Usage: bash reports/io/run.sh [tiny-trained|tiny-trained-wide]...
set -euo pipefail
cd "$(dirname "$0")/../.."
out=reports/io
models=${*:-tiny-trained tiny-trained-wide}
prepare() {  # $1: fixture name -> models/$1-stream (bundled), -stacked, heads in both
    local name=$1 src=models/$1
    [ -f "$src/config.json" ] || uv run ssdmoe fixture "$name" --out "$src"
    [ -f "models/$name-stream/manifest.json" ] || uv run ssdmoe convert "$src" "models/$name-stream"
    [ -f "models/$name-stacked/manifest.json" ] || \
        uv run ssdmoe convert "$src" "models/$name-stacked" --layout stacked
    if [ ! -f "models/$name-stream/prerouter/prerouter.json" ]; then
        if [ "$name" = tiny-trained-wide ]; then  # the same hidden states and routing
            cp -r models/tiny-trained-stream/prerouter "models/$name-stream/prerouter"
        else
            uv run ssdmoe train heads "models/$name-stream"
        fi
    fi
}
bench() {  # $1: model name, $2: regime tag, rest: bench options
    local name=$1 tag=$2
    shift 2
    uv run ssdmoe bench "models/$name-stream" --before "models/$name-stacked" \
        --arms resident,on-demand,staged,staged-prerouter --readers 2 \
        --json "$out/$name-$tag.json" "$@"
}
for name in $models; do
    prepare "$name"
    if [ "$name" = tiny-trained-wide ]; then
        bench "$name" warm --rounds 3 --max-tokens 24 --num-prompts 1
        bench "$name" quarter --rounds 3 --max-tokens 24 --num-prompts 1 --page-cache-budget 25%
        # 100 MB/s, not 15: at 15 MB/s one round takes ~25 min here (the resident arm reads
        # all 966 MiB, each staged arm's whole-layer prefill reads it twice), and decode is
        # bandwidth-bound either way, so both layouts move the same bytes
        bench "$name" quarter-100mbps --rounds 2 --max-tokens 8 --num-prompts 1 \
            --page-cache-budget 25% --read-mbps 100
    else
        bench "$name" warm --rounds 3 --max-tokens 48 --num-prompts 2
        bench "$name" quarter --rounds 3 --max-tokens 48 --num-prompts 2 --page-cache-budget 25%
        bench "$name" quarter-15mbps --rounds 3 --max-tokens 48 --num-prompts 2 \
            --page-cache-budget 25% --read-mbps 15
    fi
done
uv run python reports/io/summarize.py
