"""A simulator change judged on held-out captures: the committed transfer and curve runs of
both machines, predicted by the code of two commits on the same profiles, nothing refitted.

For each commit a git worktree is made; for each run its profiles are copied into that tree's
scenarios/ (machine A's: the committed scenarios/ of the later commit; machine B's: a run's
profiles/ folder), its transfer run and curve traces into a scratch folder, and the tree
predicts them: `ssdmoe validate --transfer scenarios/transfer/machines.toml --no-calibrate`
(which re-predicts what is already measured) and `reports/transfer/summarize.py`. Writes a
JSON of every point's decode error per commit, and prints the summaries.

Usage: uv run python reports/cross-machine/ab_predict.py BEFORE AFTER --out FILE.json
[--what TEXT]   (BEFORE, AFTER: commits; models/ is shared with the worktrees)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROFILE_FILES = {"hardware.toml": "hardware/this-machine.toml",
                 "model.toml": "models/tiny-trained.toml",
                 "scenario.toml": "this-machine-tiny-trained.toml"}
# (machine, profiles folder or None for the later commit's scenarios/, transfer run, curves run)
RUNS = (("A", None, "reports/transfer/validate", "reports/transfer"),
        ("B", "reports/cross-machine/b-validation-19/profiles",
         "reports/cross-machine/b-transfer-17", "reports/transfer/b-curves-7"))


def run(cmd: list[str], tree: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"ab_predict.py: {' '.join(cmd)} failed in {tree}: {done.stderr.strip()[-400:]}")
    return done.stdout


def errors(transfer_json: Path) -> dict[str, float]:
    """{point: simulated / measured decode - 1, in %} of a transfer.json (validate's or the
    curves')."""
    data = json.loads(transfer_json.read_text())
    rows = {r["point"]: r for r in data["results"]} if "results" in data else {
        f"{curve}/{point}": r for curve in ("memory", "cores", "hot")
        for point, r in (data.get(curve) or {}).items()}
    return {point: round(100 * (r["decode_tok_s"]["simulated"] / r["decode_tok_s"]["measured"]
                                - 1), 2) for point, r in rows.items()}


def predict(tree: Path, profiles: Path, transfer: Path, curves: Path, scratch: Path) -> dict:
    for name, dest in PROFILE_FILES.items():
        shutil.copy(profiles / name, tree / "scenarios" / dest)
    tr, cv = scratch / "transfer", scratch / "curves"
    shutil.copytree(transfer, tr, ignore=shutil.ignore_patterns("transfer.json", "README.md"))
    cv.mkdir()
    shutil.copytree(curves / "traces", cv / "traces")
    run([sys.executable, "-m", "ssdmoe_cli", "validate", "models/tiny-trained-stream",
         "--transfer", "scenarios/transfer/machines.toml", "--no-calibrate", "--rounds", "2",
         "--out", str(tr)], tree)
    run([sys.executable, "reports/transfer/summarize.py", str(cv)], tree)
    summary = json.loads((tr / "transfer.json").read_text())["summary"]
    curve_summary = json.loads((cv / "transfer.json").read_text())["summary"]
    return {"transfer": {k: summary[k] for k in ("decode_abs_error_median_pct",
                                                 "decode_abs_error_p90_pct",
                                                 "component_abs_error_median_pct")},
            "curves": {k: curve_summary[k] for k in ("decode_abs_error_median_pct",
                                                     "decode_abs_error_max_pct")},
            "points": {**errors(tr / "transfer.json"), **errors(cv / "transfer.json")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--what", default="")
    args = ap.parse_args()
    out: dict = {"what": args.what, "before": args.before, "after": args.after,
                 "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                 "command": " ".join(["uv run python reports/cross-machine/ab_predict.py",
                                      *sys.argv[1:]]), "runs": {}}
    for _, profiles, transfer, curves in RUNS:
        for where in (profiles, transfer, f"{curves}/traces"):
            if where and not (ROOT / where).is_dir():
                sys.exit(f"ab_predict.py: {where}: missing (a committed run this compares on)")
    with tempfile.TemporaryDirectory() as tmp:
        trees: dict[str, Path] = {}
        try:
            for arm in ("before", "after"):
                tree = Path(tmp) / arm
                made = subprocess.run(["git", "worktree", "add", "--detach", str(tree),
                                       getattr(args, arm)], cwd=ROOT, capture_output=True,
                                      text=True)
                if made.returncode:
                    sys.exit(f"ab_predict.py: {arm} {getattr(args, arm)!r}: not a commit here "
                             f"({made.stderr.strip().splitlines()[-1]})")
                (tree / "models").symlink_to(ROOT / "models")
                trees[arm] = tree
            a_profiles = Path(tmp) / "a-profiles"
            a_profiles.mkdir()
            for name, src in PROFILE_FILES.items():
                shutil.copy(trees["after"] / "scenarios" / src, a_profiles / name)
            for machine, profiles, transfer, curves in RUNS:
                got = out["runs"][machine] = {"profiles": profiles or "scenarios/ of " + args.after,
                                              "transfer": transfer, "curves": curves}
                for arm, tree in trees.items():
                    scratch = Path(tmp) / f"{machine}-{arm}"
                    scratch.mkdir()
                    got[arm] = predict(tree, ROOT / profiles if profiles else a_profiles,
                                       ROOT / transfer, ROOT / curves, scratch)
                    print(machine, arm, got[arm]["transfer"], got[arm]["curves"], flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                               capture_output=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
