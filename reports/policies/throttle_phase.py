"""Two policies on the staged path across read-throttle rates, measured and simulated, in one
run: `uv run python reports/policies/throttle_phase.py` (writes throttle-phase.json).

Why: at one throttle rate LFU measured 1.1-1.4% below LRU on the staged path in every round,
with 0.4% more bytes read, and the simulator put it 1.1% above. blk-throttle grants a whole
100 ms slice's bytes at the slice's start and then holds reads to the next slice, so a request's
decode time depends on where its last bytes fall against the slices. At a fixed rate that phase
is set by the bytes (the same routing and policy every round), so rounds repeat it rather than
sample it. Sweeping the rate a few percent either way samples it: if the sign of LFU/LRU
follows the rate, the difference is the slices', not the policy's.

Each rate captures both policies (their order alternating) with the report's capture settings
(run.py: 8 prompts x 32 sampled tokens, O_DIRECT) and replays each trace with `ssdmoe sim
compare` at the rate it was captured at."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import OUT, ROOT, RUNS, capture, measured, simulated  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-trained")
    ap.add_argument("--preset", default="staged")
    ap.add_argument("--policies", default="lru,lfu", help="two policies, comma separated")
    ap.add_argument("--rates", default="27,28,29,30,31,32,33", help="MB/s, comma separated")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    if len(set(policies)) != 2:
        sys.exit(f"throttle_phase: --policies needs two different policies, got {args.policies!r}")
    base, other = policies
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        sys.exit(f"throttle_phase: --rates must be MB/s numbers, comma separated, got "
                 f"{args.rates!r}")
    if not rates or min(rates) <= 0:
        sys.exit(f"throttle_phase: --rates must be above 0 MB/s, got {args.rates!r}")
    model = ROOT / "models" / f"{args.model}-stream"
    if not (model / "manifest.json").is_file():
        sys.exit(f"throttle_phase: {model}: no converted model")
    t0 = time.time()
    rows = []
    for i, rate in enumerate(rates):
        row: dict = {"read_mbps": rate}
        for policy in (base, other) if i % 2 == 0 else (other, base):
            trace = RUNS / "throttle-phase" / f"{policy}-{rate:g}"
            capture(model, ["--preset", args.preset], policy, trace, rate, args)
            m, s = measured(trace), simulated(trace)
            row[policy] = {"measured_decode_tok_s": m["decode_tok_s"],
                           "simulated_decode_tok_s": s["decode_tok_s"],
                           "mib_per_step": m["mib_per_step"],
                           "cache_hit_rate": m["cache_hit_rate"],
                           "trace": str(trace.relative_to(ROOT))}
        for side in ("measured", "simulated"):
            row[f"{side}_ratio"] = (row[other][f"{side}_decode_tok_s"]
                                    / row[base][f"{side}_decode_tok_s"])
        rows.append(row)
        print(f"[{time.time() - t0:5.0f} s] {rate:g} MB/s: {other}/{base} measured "
              f"{row['measured_ratio']:.4f}, simulated {row['simulated_ratio']:.4f}", flush=True)
    first = json.loads((ROOT / rows[0][base]["trace"] / "run.json").read_text())
    result = {
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                             time.gmtime(t0)),
        "wall_s": time.time() - t0, "machine": os.uname().nodename, "model": args.model,
        "manifest_sha256": first["model"]["manifest_sha256"], "preset": args.preset,
        "policies": [base, other], "rows": rows,
        "median_ratio": {side: statistics.median(r[f"{side}_ratio"] for r in rows)
                         for side in ("measured", "simulated")},
        "sign_changes": {side: sum(1 for a, b in zip(rows, rows[1:], strict=False)
                                   if (a[f"{side}_ratio"] - 1) * (b[f"{side}_ratio"] - 1) < 0)
                         for side in ("measured", "simulated")}}
    (OUT / "throttle-phase.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"| MB/s | {other}/{base} measured | simulated |\n|---|---|---|")
    for r in rows:
        print(f"| {r['read_mbps']:g} | {r['measured_ratio']:.4f} | {r['simulated_ratio']:.4f} |")
    print(f"| median | {result['median_ratio']['measured']:.4f} | "
          f"{result['median_ratio']['simulated']:.4f} |")


if __name__ == "__main__":
    main()
