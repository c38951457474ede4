"""`ssdmoe advise` confirmed on emulated machines: `uv run python reports/advise/confirm.py`.

For each machine of scenarios/advise/machines.toml and each model: `ssdmoe advise` runs on this
machine's calibrated profile with the machine's settings (nothing of the candidates measured),
then a fixed grid of real configurations (chosen before any advice: every arm, pool sizes,
reads in flight, policies) plus the recommended one is captured with `ssdmoe capture`
(sampled decoding), `--rounds` times with the order rotated each round; decode tok/s is the
median over rounds. Each trace is also replayed by `sim compare` (simulated for exactly that
run), so a miss can be traced to the mechanism. On the quarter machine advise is given a
memory ceiling (the on-demand engine plus a quarter of the expert bytes: the app caches share
the quarter the page cache has), and the best measured is taken among the configurations within
it.

Writes reports/advise/confirm/MODEL-MACHINE.json (every round, the commands, the model's
manifest sha256), summary.json, and the table in reports/advise/README.md between its
markers; prints the table."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from advise.machine import load_machine  # noqa: E402
from advise.model import load_model  # noqa: E402
from advise.space import Candidate  # noqa: E402

OUT = ROOT / "reports" / "advise" / "confirm"
RUNS = ROOT / "runs" / "advise-confirm"
MACHINES = ROOT / "scenarios" / "advise" / "machines.toml"
PROMPTS = ROOT / "reports" / "transfer" / "validate" / "prompts.jsonl"
README = ROOT / "reports" / "advise" / "README.md"
MARK_BEGIN, MARK_END = "<!-- table: confirm.py -->", "<!-- /table -->"
CEILING = {"quarter-100mbps": 0.5}  # machine -> the engine's share of the expert bytes


def ssdmoe(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "ssdmoe_cli", *args], cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"ssdmoe {' '.join(args)}: {(p.stderr or p.stdout).strip().splitlines()[-1]}")
    return p.stdout


def grid(k: int, readers: int) -> list[Candidate]:
    """The measured configurations, fixed before any advice."""
    return [
        Candidate("on-demand", k),
        Candidate("hot", k, hot_fraction=0.1, readers=readers, cache_policy="lru"),
        Candidate("hot", k, hot_fraction=0.25, readers=readers, cache_policy="lru"),
        Candidate("hot", k, hot_fraction=0.25, readers=1, cache_policy="lru"),
        Candidate("hot", k, hot_fraction=0.25, readers=readers, cache_policy="lfu"),
        Candidate("hot", k, hot_fraction=0.5, readers=readers, cache_policy="least-stale"),
        Candidate("hot", k, hot_fraction=1.0, readers=readers, cache_policy="lru"),
        Candidate("staged", k, headroom=k, readers=readers, cache_policy="lru"),
        Candidate("staged", k, headroom=k, readers=1, cache_policy="lru"),
        Candidate("staged", k, headroom=2 * k, readers=readers, cache_policy="least-stale"),
        Candidate("staged-layer", k, headroom=k, readers=readers, cache_policy="lru"),
        Candidate("staged-token", k, headroom=k, readers=readers, cache_policy="lru"),
        Candidate("staged-token", k, headroom=2 * k, readers=1, cache_policy="lru"),
    ]


def with_budget_policy(c: Candidate, machine) -> Candidate:
    """On a machine with the engine's page-cache budget, on-demand has a policy too (lru)."""
    if c.cache_policy is None and machine.page_cache_fraction is not None:
        return Candidate(**{**c.as_dict(), "cache_policy": "lru"})
    return c


def candidate(d: dict) -> Candidate:
    return Candidate(**{k: d[k] for k in ("arm", "k", "hot_fraction", "headroom", "readers",
                                          "cache_policy")})


def run_one(model: Path, machine_name: str, args) -> dict:
    machine = load_machine(MACHINES, machine_name)
    info = load_model(str(model))  # expert bytes, calibrated readers, native K
    name = f"{model.name}-{machine_name}"
    advice_dir = OUT / name
    advise_cmd = ["advise", str(model.relative_to(ROOT)), "--machines",
                  str(MACHINES.relative_to(ROOT)), "--machine", machine_name, "--out",
                  str(advice_dir.relative_to(ROOT))]
    ceiling = None
    if machine_name in CEILING:
        probe = json.loads(_advise(advise_cmd + ["--arm", "on-demand"], advice_dir))
        base = probe["candidates"][0]["predicted"]["peak_engine_bytes"]
        ceiling = int(base + CEILING[machine_name] * info.expert_bytes)
        advise_cmd += ["--max-memory", str(ceiling)]
    started = time.time()
    advice = json.loads(_advise(advise_cmd, advice_dir))
    advise_s = time.time() - started
    rec = candidate(advice["recommended"])
    predicted = {c["label"]: c["predicted"] for c in advice["candidates"]}
    configs = [with_budget_policy(c, machine) for c in grid(info.k, info.readers)]
    if rec not in configs:
        configs.append(rec)
    heads = str(model / "prerouter")
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        shift = (r * 5) % len(configs)
        order = configs[shift:] + configs[:shift]
        got: dict[str, dict] = {}
        for i, c in enumerate(order, 1):
            out = RUNS / name / f"r{r}" / c.label.replace(", ", "_").replace(" ", "-")
            flags = c.capture_flags(heads, info.bundle_bytes, info.expert_bytes)
            cmd = ["capture", str(model.relative_to(ROOT)), *flags, "--no-lora",
                   *machine.flags(), "--prompts", str(PROMPTS.relative_to(ROOT)),
                   "--max-tokens", str(args.max_tokens), "--out", str(out), "--force",
                   "--no-progress", "--no-verify"]
            print(f"[{name} round {r + 1}/{args.rounds}, {i}/{len(order)}] {c.label}",
                  flush=True)
            ssdmoe(*cmd)
            summary = json.loads(ssdmoe("trace", "summary", str(out), "--json"))
            compared = json.loads(ssdmoe("sim", "compare", str(out), "--json"))
            got[c.label] = {"measured": summary.get("decode_tok_s"),
                            "replayed": compared["metrics"]["decode_tok_s"]["simulated"],
                            "command": "ssdmoe " + " ".join(cmd)}
        rounds.append(got)
    rows = []
    for c in configs:
        m = [rd[c.label]["measured"] for rd in rounds]
        s = [rd[c.label]["replayed"] for rd in rounds]
        p = predicted.get(c.label) or {}
        rows.append({"label": c.label, **c.as_dict(), "measured": statistics.median(m),
                     "measured_rounds": m, "replayed": statistics.median(s),
                     "predicted": p.get("decode_tok_s"),
                     "engine_bytes": p.get("peak_engine_bytes"),
                     "allowed": ceiling is None or (p.get("peak_engine_bytes") or 0) <= ceiling,
                     "default": c.arm == "on-demand", "recommended": c == rec})
    allowed = [r for r in rows if r["allowed"]]
    best = max(allowed, key=lambda r: r["measured"])
    rec_row = next(r for r in rows if r["recommended"])
    default_row = next(r for r in rows if r["default"])
    result = {
        "model": model.name, "machine": machine_name, "describe": machine.describe(),
        "manifest_sha256": hashlib.sha256((model / "manifest.json").read_bytes()).hexdigest(),
        "advise_command": "ssdmoe " + " ".join(advise_cmd), "advise_s": advise_s,
        "ceiling_bytes": ceiling, "recommended": rec.label, "why": advice["recommended"]["why"],
        "rows": rows, "best_measured": best["label"],
        "recommended_over_best": rec_row["measured"] / best["measured"],
        "recommended_over_default": rec_row["measured"] / default_row["measured"],
        "met": rec_row["measured"] >= 0.95 * best["measured"]
        and rec_row["measured"] > default_row["measured"],
        "rounds": rounds, "max_tokens": args.max_tokens, "prompts": str(PROMPTS.relative_to(ROOT)),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _advise(cmd: list[str], out: Path) -> str:
    ssdmoe(*cmd)
    return (out / "advise.json").read_text()


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two lists (ties ranked by position: the grid has few)."""
    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0] * len(v)
        for rank, i in enumerate(order):
            out[i] = rank
        return out
    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def table(results: list[dict]) -> str:
    lines = ["| model | machine | recommended | its measured tok/s | best measured (config) | "
             "rec / best | rec / default (on-demand) | rank correlation, predicted vs measured "
             "| met |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rec = next(x for x in r["rows"] if x["recommended"])
        best = next(x for x in r["rows"] if x["label"] == r["best_measured"])
        rho = spearman([x.get("predicted_now") or x["predicted"] for x in r["rows"]],
                       [x["measured"] for x in r["rows"]])
        lines.append(f"| {r['model']} | {r['machine']} | {r['recommended']} | "
                     f"{rec['measured']:.1f} (predicted {rec['predicted']:.1f}) | "
                     f"{best['measured']:.1f} ({best['label']}) | "
                     f"{r['recommended_over_best']:.3f} | {r['recommended_over_default']:.2f}x | "
                     f"{rho:.2f} | "
                     f"{'yes' if r['met'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-trained-stream",
                                                    "tiny-trained-wide-stream"])
    ap.add_argument("--machines", nargs="+", default=["all-ram", "quarter-100mbps", "one-core"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--table-only", action="store_true", help="Rebuild the summary only.")
    ap.add_argument("--refresh-advice", action="store_true", help="Run each recorded advise "
                    "command again (after a change to advise's wording or the simulator): the "
                    "recommendation must stay the one measured; its reason is updated.")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.refresh_advice:
        for path in sorted(OUT.glob("*.json")):
            if path.name == "summary.json":
                continue
            r = json.loads(path.read_text())
            cmd = r["advise_command"].split()[1:]
            advice = json.loads(_advise(cmd, ROOT / cmd[cmd.index("--out") + 1]))
            if advice["recommended"]["label"] != r["recommended"]:
                sys.exit(f"{path}: advise now recommends {advice['recommended']['label']}, "
                         f"not the measured {r['recommended']}: measure again")
            r["why"] = advice["recommended"]["why"]
            now = {c["label"]: c["predicted"]["decode_tok_s"] for c in advice["candidates"]}
            for row in r["rows"]:  # what the simulator says today (advice time's is kept)
                row["predicted_now"] = now.get(row["label"])
            path.write_text(json.dumps(r, indent=1) + "\n")
    elif not args.table_only:
        for model in args.models:
            for machine in args.machines:
                run_one(ROOT / "models" / model, machine, args)
    results = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))
               if p.name != "summary.json"]
    (OUT / "summary.json").write_text(json.dumps(
        [{k: r[k] for k in ("model", "machine", "recommended", "best_measured",
                            "recommended_over_best", "recommended_over_default", "met")}
         for r in results], indent=1) + "\n")
    text = table(results)
    if README.is_file() and MARK_BEGIN in README.read_text():
        before, rest = README.read_text().split(MARK_BEGIN, 1)
        README.write_text(f"{before}{MARK_BEGIN}\n{text}\n{MARK_END}{rest.split(MARK_END, 1)[1]}")
    print(text)


if __name__ == "__main__":
    main()
