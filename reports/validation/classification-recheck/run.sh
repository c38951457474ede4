set -e
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/recap}; mkdir -p "$out"
cfgs=("on-demand-pc25-15mbps:--read-mbps 15" "on-demand-pc25-unthrottled:")
for r in 0 1 2; do
  for i in 0 1; do
    j=$(( (i + r) % 2 )); c=${cfgs[$j]}; name=${c%%:*}; extra=${c#*:}
    echo "$(date +%T) round $r $name"
    uv run ssdmoe capture models/tiny-trained-stream --out $out/$name.r$r --force --no-progress --prompts reports/validation/prompts.jsonl --max-tokens 96 --temp 1.0 --seed 0 --preset on-demand --page-cache-fraction 0.25 $extra > $out/$name.r$r.log 2>&1
  done
done
echo done
