"""Cache policies measured and simulated, in one run: `uv run python reports/policies/run.py`.

For each model and cache configuration (the hot path's pool at ~5% and ~25% of the expert
bytes, the staged path with its default headroom), every engine policy is captured with
`ssdmoe capture` (sampled decoding, O_DIRECT so that every app-cache miss reads the device,
under a read throttle so that storage matters), `--rounds` times with the policies' order
rotated each round. Under a throttle each round runs at its own rate, spread around the
nominal one (`--rate-spread`): blk-throttle grants bytes in 100 ms slices, so a run's tok/s
depends on where each request's bytes fall against the slices, a phase that one rate repeats
in every round and that can put two policies 1-2% apart either way (throttle_phase.py). Each
trace is then replayed by `ssdmoe sim compare` at its own rate (no refit: the committed
profile), and on the hot path Belady's optimum is simulated on the same routing.
A hit-rate curve per policy over pool sizes is simulated from one trace's routing.

Writes reports/policies/MODEL.json per model (every round's raw figures, the commands, the
model's manifest sha256), then from every such JSON hit-rate.png and the table in README.md
between its markers; prints the table."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "reports" / "policies"
RUNS = ROOT / "runs" / "policies"
POLICIES = ("lru", "lfu", "least-stale", "fifo")
CURVE_FRACTIONS = (0.02, 0.05, 0.1, 0.25, 0.5)
RATE_OFFSETS = (0.0, -1.0, 1.0)  # round r's throttle: nominal x (1 + spread x RATE_OFFSETS[r % 3])
MARK_BEGIN, MARK_END = "<!-- table: run.py -->", "<!-- /table -->"


def ssdmoe(*args: str) -> str:
    cmd = [sys.executable, "-m", "ssdmoe_cli", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"ssdmoe {' '.join(args)}: {(p.stderr or p.stdout).strip().splitlines()[-1]}")
    return p.stdout


def expert_bytes(model: Path) -> int:
    m = json.loads((model / "manifest.json").read_text())
    return m["bundle_bytes"] * m["num_experts"] * len(m["layers"])


def configs(model: Path) -> list[tuple[str, list[str]]]:
    total_mib = expert_bytes(model) / 2**20
    return [("hot 5%", ["--preset", "hot", "--hot-mb", f"{0.05 * total_mib:.4f}"]),
            ("hot 25%", ["--preset", "hot", "--hot-mb", f"{0.25 * total_mib:.4f}"]),
            ("staged", ["--preset", "staged"])]


def round_rate(args, r: int) -> float:
    """Round r's read throttle in MB/s (0: none)."""
    return round(args.read_mbps * (1 + args.rate_spread * RATE_OFFSETS[r % len(RATE_OFFSETS)]),
                 3)


def capture(model: Path, config: list[str], policy: str, out: Path, rate: float,
            args) -> list[str]:
    cmd = ["capture", str(model), *config, "--o-direct", "--cache-policy", policy,
           "--max-tokens", str(args.max_tokens), "--out", str(out), "--force", "--no-progress"]
    if rate:
        cmd += ["--read-mbps", f"{rate:g}"]
    ssdmoe(*cmd)
    return cmd


def measured(trace: Path) -> dict:
    return json.loads(ssdmoe("trace", "summary", str(trace), "--json"))


def simulated(trace: Path, *sets: str) -> dict:
    extra = [x for s in sets for x in ("--set", s)]
    out = json.loads(ssdmoe("sim", "compare", str(trace), "--json", *extra))
    return {k: v["simulated"] for k, v in out["metrics"].items()}


KEYS = ("decode_tok_s", "cache_hit_rate", "loads_per_step", "blocked_ms_per_step")


def run(name: str, args) -> dict:
    """Every configuration and policy of one model, measured and simulated."""
    model = ROOT / "models" / f"{name}-stream"
    if not (model / "manifest.json").is_file():
        sys.exit(f"{model}: no converted model (ssdmoe fixture {name} --out models/{name}; "
                 f"ssdmoe convert models/{name} {model})")
    t0 = time.time()
    per_model: dict = {"configs": {}, "order": [], "config_runs": {}}
    for label, config in configs(model):
        if args.configs and label not in args.configs:
            continue
        per_model["config_runs"][label] = {
            "command": " ".join(sys.argv), "rounds": args.rounds,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "round_read_mbps": [round_rate(args, r) for r in range(args.rounds)]}
        cells = {p: {"measured": [], "simulated": [], "traces": []} for p in POLICIES}
        for r in range(args.rounds):
            order = POLICIES[r % len(POLICIES):] + POLICIES[:r % len(POLICIES)]
            per_model["order"].append([label, r, list(order)])
            for policy in order:
                trace = RUNS / name / label.replace(" ", "-").replace("%", "") / \
                    f"{policy}-r{r}"
                cmd = capture(model, config, policy, trace, round_rate(args, r), args)
                summary = measured(trace)
                cells[policy]["measured"].append({k: summary[k] for k in KEYS})
                cells[policy]["traces"].append(str(trace.relative_to(ROOT)))
                cells[policy].setdefault("commands", []).append("ssdmoe " + " ".join(cmd))
                print(f"[{time.time() - t0:6.0f} s] {name} {label} round {r} {policy}: "
                      f"{cells[policy]['measured'][-1]['decode_tok_s']:.2f} tok/s", flush=True)
        first = json.loads((ROOT / cells["lru"]["traces"][0] / "run.json").read_text())
        per_model["manifest_sha256"] = first["model"]["manifest_sha256"]
        per_model["configs"][label] = cells
    simulate(model, per_model)
    if "hot 5%" in per_model["configs"]:
        per_model["reuse_distance_share"] = reuse_distances(
            ROOT / per_model["configs"]["hot 5%"]["lru"]["traces"][0])
    return {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                   time.gmtime(t0)),
            "max_tokens": args.max_tokens, "read_mbps": args.read_mbps, "rounds": args.rounds,
            "round_read_mbps": [round_rate(args, r) for r in range(args.rounds)],
            "wall_s": time.time() - t0, "machine": os.uname().nodename,
            "models": {name: per_model}}


def simulate(model: Path, per_model: dict) -> None:
    """The simulator's side of every captured trace (replayed with its own policy; Belady on
    each hot-pool LRU trace) and the hit-rate curve, from the traces on disk."""
    for label, cells in per_model["configs"].items():
        for policy in POLICIES:
            cells[policy]["simulated"] = [
                {k: v for k, v in simulated(ROOT / t).items() if k in KEYS}
                for t in cells[policy]["traces"]]
        if label.startswith("hot"):  # the optimum on each round's routing (the LRU trace)
            cells["belady"] = {"measured": [], "traces": list(cells["lru"]["traces"]),
                               "simulated": [
                {k: v for k, v in simulated(ROOT / t, "cache_policy=belady").items()
                 if k in KEYS} for t in cells["lru"]["traces"]]}
    if "hot 5%" in per_model["configs"]:
        per_model["curve"] = curve(model, per_model["configs"]["hot 5%"]["lru"]["traces"][0])


def curve(model: Path, trace: str) -> dict:
    """Simulated hit rate against the pool's size, per policy, on one trace's routing."""
    total = expert_bytes(model)
    out: dict = {"fractions": list(CURVE_FRACTIONS), "trace": trace}
    for policy in (*POLICIES, "belady"):
        out[policy] = [simulated(ROOT / trace, f"cache_policy={policy}",
                                 f"lru_bytes={int(f * total)}")["cache_hit_rate"]
                       for f in CURVE_FRACTIONS]
    return out


def reuse_distances(trace: Path) -> dict:
    """How far back (in tokens, same layer, same request) each decode access's expert was
    last used: the share of accesses per distance bucket (what a policy can exploit)."""
    sys.path.insert(0, str(ROOT))
    import polars as pl

    from traces.reader import read_trace

    t = read_trace(trace)
    decode = t.steps.filter(pl.col("phase") == "decode").select("step", "request")
    rows = t.routing.join(decode, on="step").sort("request", "step", "layer")
    last: dict = {}
    buckets = {"1": 0, "2": 0, "3-4": 0, "5-8": 0, "9-16": 0, "17+": 0, "new": 0}
    position: dict = {}
    for request, step, layer, experts in rows.select(
            "request", "step", "layer", "experts").iter_rows():
        pos = position.setdefault((request, step), len(position))
        for e in experts:
            prev = last.get((request, layer, e))
            last[(request, layer, e)] = pos
            d = None if prev is None else pos - prev
            key = "new" if d is None else "1" if d == 1 else "2" if d == 2 else \
                "3-4" if d <= 4 else "5-8" if d <= 8 else "9-16" if d <= 16 else "17+"
            buckets[key] += 1
    total = sum(buckets.values())
    return {k: v / total for k, v in buckets.items()}


def summarize(result: dict) -> list[dict]:
    rows = []
    for name, per_model in result["models"].items():
        for label, cells in per_model["configs"].items():
            lru_tok = {side: [m["decode_tok_s"] for m in cells["lru"][side]]
                       for side in ("measured", "simulated")}
            for policy, cell in cells.items():
                med = {k: statistics.median(m[k] for m in cell["measured"])
                       for k in KEYS} if cell["measured"] else {}
                sim = {k: statistics.median(s[k] for s in cell["simulated"]) for k in KEYS}
                # Belady's rounds are replays of each round's LRU trace: paired like the others
                paired = {side: [m["decode_tok_s"] / base for m, base in zip(
                    cell[side], lru_tok[side], strict=True)] if cell[side] else []
                    for side in ("measured", "simulated")}
                rows.append({"model": name, "config": label, "policy": policy, **{
                    f"measured_{k}": med.get(k) for k in KEYS}, **{
                    f"simulated_{k}": sim[k] for k in KEYS},
                    "paired_vs_lru": statistics.median(paired["measured"])
                    if paired["measured"] else None,
                    "paired_rounds": paired["measured"],
                    "simulated_paired_vs_lru": statistics.median(paired["simulated"])})
    return rows


def null_band(rows: list[dict], model: str) -> float | None:
    """How far apart two policies with the same reads measure: on the staged path
    Least-Stale is LRU (a per-layer table keeps every key of the current call), so its paired
    ratio against LRU is the run's own noise (the throttle's slice phase, the VM's drift).
    The largest deviation over the rounds; None where the control's hit rate is not LRU's
    (then the two did not read the same)."""
    cell = {r["policy"]: r for r in rows if (r["model"], r["config"]) == (model, "staged")}
    ctl, lru = cell.get("least-stale"), cell.get("lru")
    if not ctl or not lru or ctl["measured_cache_hit_rate"] != lru["measured_cache_hit_rate"]:
        return None
    return max(abs(x - 1) for x in ctl["paired_rounds"])


def separated(a: dict, b: dict) -> bool:
    """Every round's paired ratio of one policy above every round's of the other."""
    return min(a["paired_rounds"]) > max(b["paired_rounds"]) or \
        min(b["paired_rounds"]) > max(a["paired_rounds"])


def resolved(a: dict, b: dict, band: float) -> bool:
    """A difference the run resolves: separated in every round, and wider than two policies
    with the same reads drift apart (`null_band`)."""
    return separated(a, b) and abs(a["paired_vs_lru"] - b["paired_vs_lru"]) > band


def ordering(cell: list[dict], key: str, tied) -> str:
    """The policies by `key`, best first; neighbours that `tied(a, b)` joined by '='."""
    ranked = sorted(cell, key=lambda r: -r[key])
    out = ranked[0]["policy"]
    for a, b in zip(ranked, ranked[1:], strict=False):
        out += (" = " if tied(a, b) else " > ") + b["policy"]
    return out


def rankings(rows: list[dict]) -> list[dict]:
    """Per (model, config): the measured order of the engine policies by paired decode tok/s,
    with the differences the run does not resolve as ties; the simulator's order by its own
    paired tok/s (ties within the same band); and whether the simulator orders every resolved
    pair as the machine does."""
    out = []
    for key in sorted({(r["model"], r["config"]) for r in rows}):
        cell = [r for r in rows if (r["model"], r["config"]) == key and r["policy"] in POLICIES]
        band = null_band(rows, key[0])
        band = 0.0 if band is None else band
        pairs = [(a, b) for i, a in enumerate(cell) for b in cell[i + 1:]
                 if resolved(a, b, band)]
        pairs = [(a, b) if a["paired_vs_lru"] > b["paired_vs_lru"] else (b, a) for a, b in pairs]
        agree = [a["simulated_paired_vs_lru"] > b["simulated_paired_vs_lru"] for a, b in pairs]
        hit_err = max(abs(r["simulated_cache_hit_rate"] - r["measured_cache_hit_rate"])
                      for r in cell)
        out.append({
            "model": key[0], "config": key[1], "null_band": band,
            "measured": ordering(cell, "paired_vs_lru", lambda a, b, w=band: not resolved(a, b, w)),
            "simulated": ordering(cell, "simulated_paired_vs_lru", lambda a, b, w=band: abs(
                a["simulated_paired_vs_lru"] - b["simulated_paired_vs_lru"]) <= w),
            "resolved_pairs": [[a["policy"], b["policy"], ok]
                               for (a, b), ok in zip(pairs, agree, strict=True)],
            "resolved_pairs_agreeing": sum(agree), "resolved_pairs_agree": all(agree),
            "max_hit_rate_error": hit_err})
    return out


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict], ranks: list[dict]) -> str:
    lines = ["| model | cache | policy | decode tok/s measured (paired vs lru) | simulated | "
             "hit rate measured / simulated | loads/step measured / simulated | blocked ms/step "
             "measured / simulated |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['config']} | {r['policy']} | "
            f"{fmt(r['measured_decode_tok_s'], '.2f')} ({fmt(r['paired_vs_lru'], '.3f')}x) | "
            f"{fmt(r['simulated_decode_tok_s'], '.2f')} | "
            f"{fmt(r['measured_cache_hit_rate'], '.3f')} / "
            f"{fmt(r['simulated_cache_hit_rate'], '.3f')} | "
            f"{fmt(r['measured_loads_per_step'], '.1f')} / "
            f"{fmt(r['simulated_loads_per_step'], '.1f')} | "
            f"{fmt(r['measured_blocked_ms_per_step'], '.1f')} / "
            f"{fmt(r['simulated_blocked_ms_per_step'], '.1f')} |")
    lines += ["", "| model | cache | measured order (=: not resolved) | simulated order | "
              "pairs the run resolves (simulator alike?) | noise band (same reads) | largest "
              "hit-rate error |", "|---|---|---|---|---|---|---|"]
    for k in ranks:
        pairs = ", ".join(f"{a} > {b} ({'yes' if ok else 'NO'})"
                          for a, b, ok in k["resolved_pairs"]) or "none"
        lines.append(f"| {k['model']} | {k['config']} | {k['measured']} | {k['simulated']} | "
                     f"{pairs} | {k['null_band']:.3f} | "
                     f"{k['max_hit_rate_error']:.3f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        per_model = result["models"][name]
        c = per_model["curve"]
        xs = [100 * f for f in c["fractions"]]
        for policy in (*POLICIES, "belady"):
            ax.plot(xs, c[policy], marker="o", label=f"{policy} (simulated)",
                    linestyle="--" if policy == "belady" else "-")
        for label, frac in (("hot 5%", 5), ("hot 25%", 25)):
            for policy in POLICIES:
                rates = [m["cache_hit_rate"]
                         for m in per_model["configs"][label][policy]["measured"]]
                ax.scatter([frac] * len(rates), rates, marker="x", color="k", s=14)
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}%" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("hot pool, % of the expert bytes")
        ax.set_ylabel("app-cache hit rate (decode)")
        ax.set_title(f"{name}: x = measured (every policy, every round)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-trained", help="fixture names, comma separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--read-mbps", type=float, default=30.0, help="0: no throttle")
    ap.add_argument("--rate-spread", type=float, default=0.1,
                    help="rounds run at the nominal rate x (1, 1 - spread, 1 + spread), "
                    "repeating (0: every round at the nominal rate)")
    ap.add_argument("--configs", type=lambda v: [c for c in v.split(",") if c], default=[],
                    help="only these caches (of: hot 5%%, hot 25%%, staged), comma separated; "
                    "the model's JSON keeps its other cells")
    ap.add_argument("--from-json", action="store_true",
                    help="re-render the table, plot and README from the models' JSONs")
    ap.add_argument("--resimulate", action="store_true",
                    help="replay the traces the models' JSONs name again (after a simulator "
                    "change; needs them under runs/policies), then re-render")
    args = ap.parse_args()
    unknown = [c for c in args.configs if c not in ("hot 5%", "hot 25%", "staged")]
    if unknown:
        sys.exit(f"run.py: unknown --configs {', '.join(unknown)} (of: hot 5%, hot 25%, staged)")
    if args.rounds < 1 or not 0 <= args.rate_spread < 1:
        sys.exit(f"run.py: --rounds must be at least 1 and --rate-spread in [0, 1), got "
                 f"{args.rounds} and {args.rate_spread}")
    missing = [m for m in args.models.split(",") if m and not (OUT / f"{m}.json").is_file()]
    if args.configs and missing:  # the others' cells (the curve: hot 5%) come from the JSON
        sys.exit(f"run.py: --configs re-runs cells of an existing {OUT / (missing[0] + '.json')}"
                 "; run every cache of that model first (no --configs)")
    if args.resimulate:
        for path in sorted(OUT.glob("*.json")):
            result = json.loads(path.read_text())
            for name, per_model in result.get("models", {}).items():
                simulate(ROOT / "models" / f"{name}-stream", per_model)
                result["resimulated"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                path.write_text(json.dumps(result, indent=1) + "\n")
    elif not args.from_json:
        for name in [m for m in args.models.split(",") if m]:
            result = run(name, args)
            path = OUT / f"{name}.json"
            if args.configs and path.is_file():  # only these cells again: keep the others
                kept = json.loads(path.read_text())
                old, new = kept["models"][name], result["models"][name]
                old["configs"].update(new["configs"])
                old.setdefault("config_runs", {}).update(new["config_runs"])
                old["order"] = [o for o in old["order"] if o[0] not in new["configs"]] + \
                    new["order"]
                result = kept
            path.write_text(json.dumps(result, indent=1) + "\n")
    result = {"models": {}}
    for path in sorted(OUT.glob("*.json")):  # the models' runs (not summary.json, rechecks)
        result["models"].update(json.loads(path.read_text()).get("models", {}))
    result["rows"] = summarize(result)
    result["rankings"] = rankings(result["rows"])
    reuse = {name: m.get("reuse_distance_share") or reuse_distances(
        ROOT / m["configs"]["hot 5%"]["lru"]["traces"][0]) for name, m in result["models"].items()}
    (OUT / "summary.json").write_text(json.dumps(
        {"rows": result["rows"], "rankings": result["rankings"],
         "reuse_distance_share": reuse}, indent=1) + "\n")
    plot(result, OUT / "hit-rate.png")
    text = table(result["rows"], result["rankings"])
    readme = OUT / "README.md"
    if readme.is_file() and MARK_BEGIN in readme.read_text():
        body = readme.read_text()
        head, rest = body.split(MARK_BEGIN, 1)
        tail = rest.split(MARK_END, 1)[1]
        readme.write_text(f"{head}{MARK_BEGIN}\n{text}\n{MARK_END}{tail}")
    print(text)


if __name__ == "__main__":
    main()
