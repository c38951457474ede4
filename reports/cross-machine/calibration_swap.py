"""What one calibration decides: the same captures predicted from two calibrations of B.

Two fresh runs on B, 3 h apart, each a calibration and captures right after it:
  b-validation-12 (calibrate 20:19 UTC, with the reclaim figure measured at 20:56: b-curves'
  profiles) -> b-transfer-9, reports/transfer/b-curves
  b-validation-13 (calibrate 23:11 UTC) -> b-transfer-10, reports/transfer/b-curves-2, and
  1.5 h after it b-transfer-11
Each capture set is predicted here from both calibrations (nothing refitted, the same code), and
b-curves from the later calibration with single figures of the earlier one put in, one at a
time: which figure moves the prediction. Transfer sets: `ssdmoe validate --transfer ...
--no-calibrate --out` on a copy without transfer.json; curves: reports/transfer/summarize.py on a
copy of traces/. The calibration's profiles go in scenarios/ for each prediction, and scenarios/
is restored at the end.

Usage: uv run python reports/cross-machine/calibration_swap.py [OUT.json] [KEY=VALUE ...]
(~5 min; writes OUT.json, by default calibration-swap.json beside this file, and prints the
table). KEY=VALUE: a hardware figure both calibrations' profiles are given (one that a later
`calibrate` measures and theirs predates, or measures another way: it replaces theirs), said in
OUT.json.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from sim.scenario import HARDWARE_KEYS  # noqa: E402

# b-validation-12's calibrate plus the reclaim figure measured 37 min after it (that
# calibrate predates the probe; b-validation-13's has it): the profiles of b-curves
PROFILES = {"b-validation-12": ROOT / "reports" / "transfer" / "b-curves" / "profiles",
            "b-validation-13": HERE / "b-validation-13" / "profiles"}
CAPTURES = {"b-transfer-9": ("transfer", HERE / "b-transfer-9"),
            "b-transfer-10": ("transfer", HERE / "b-transfer-10"),
            "b-transfer-11": ("transfer", HERE / "b-transfer-11"),
            "b-curves": ("curves", ROOT / "reports" / "transfer" / "b-curves"),
            "b-curves-2": ("curves", ROOT / "reports" / "transfer" / "b-curves-2")}
# (capture set, calibration, hardware keys taken from the other calibration)
PLAN = [(c, p, ()) for c in CAPTURES for p in PROFILES] + [
    ("b-curves", "b-validation-13", (key,)) for key in
    ("expert_gbps", "memcpy_gbps", "ssd_bandwidth_gbps", "cold_read_cpu_us_per_page")] + [
    ("b-curves", "b-validation-13",
     ("expert_gbps", "memcpy_gbps", "ssd_bandwidth_gbps", "zero_fill_gbps"))]
POINT_KEYS = ("decode_tok_s", "blocked_ms_per_step", "build_ms_per_step", "eval_ms_per_step")
SCENARIOS = {"hardware.toml": ROOT / "scenarios/hardware/this-machine.toml",
             "model.toml": ROOT / "scenarios/models/tiny-trained.toml",
             "scenario.toml": ROOT / "scenarios/this-machine-tiny-trained.toml"}


def hardware_value(path: Path, key: str) -> str:
    m = re.search(rf"^{key} = ([^ #\n]+)", path.read_text(), re.M)
    if not m:
        raise SystemExit(f"{path}: no {key}")
    return m.group(1)


def use_profiles(profiles: Path, keys: tuple[str, ...], other: Path,
                 added: dict[str, str] | None = None) -> None:
    """Install `profiles` in scenarios/, with `keys` of the hardware profile taken from `other`
    and `added` hardware figures (ones a later calibrate measures, or measures another way) put
    in, replacing the profile's own."""
    for name, dest in SCENARIOS.items():
        shutil.copy(profiles / name, dest)
    hw = SCENARIOS["hardware.toml"]
    text = hw.read_text()
    for key in keys:
        value = hardware_value(other / "hardware.toml", key)
        text = re.sub(rf"^{key} = [^ #\n]+", f"{key} = {value}", text, flags=re.M)
    for key, value in (added or {}).items():
        line = f"{key} = {value}  # set by calibration_swap.py"
        text, n = re.subn(rf"^{key} = .*$", line, text, flags=re.M)
        if not n:
            text += line + "\n"
    hw.write_text(text)


def predict(kind: str, source: Path, scratch: Path) -> dict:
    out = scratch / "run"
    shutil.rmtree(out, ignore_errors=True)
    cli = [sys.executable, "-m", "ssdmoe_cli"]
    if kind == "transfer":
        shutil.copytree(source, out, ignore=shutil.ignore_patterns("transfer.json", "README.md"))
        cmd = cli + ["validate", "models/tiny-trained-stream", "--transfer",
                     "scenarios/transfer/machines.toml", "--no-calibrate", "--rounds", "2",
                     "--out", str(out)]
    else:
        shutil.copytree(source / "traces", out / "traces")
        cmd = [sys.executable, "reports/transfer/summarize.py", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{source}: prediction failed: {p.stderr.strip()[-300:]}")
    report = json.loads((out / "transfer.json").read_text())
    s = report["summary"]
    rows = report["results"] if kind == "transfer" else \
        [{"point": f"{curve}/{name}", **p} for curve in ("memory", "cores", "hot")
         for name, p in report.get(curve, {}).items()]
    return {"median_pct": s["decode_abs_error_median_pct"],
            "p90_pct": s.get("decode_abs_error_p90_pct"),
            "max_pct": s.get("decode_abs_error_max_pct"),
            "components_median_pct": s.get("component_abs_error_median_pct"),
            # each point's (measured, simulated): the components behind the errors
            "points": {r["point"]: {k: [r[k]["measured"], r[k]["simulated"]] for k in POINT_KEYS}
                       for r in rows if "failed" not in r}}


def main() -> None:
    for where in [*PROFILES.values(), *(source for _, source in CAPTURES.values())]:
        if not where.is_dir():
            raise SystemExit(f"calibration_swap.py: {where}: missing (a committed report folder)")
    args = sys.argv[1:]
    out = Path(args.pop(0)) if args and "=" not in args[0] else HERE / "calibration-swap.json"
    added = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or key not in HARDWARE_KEYS:
            raise SystemExit(f"calibration_swap.py: {arg}: not KEY=VALUE of a hardware key "
                             "(docs/simulator.md lists them)")
        added[key] = value
    # one at a time: two runs would install their profiles over each other's and each restore
    # the other's as the committed ones
    lock = os.open(ROOT / "scenarios", os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit("calibration_swap.py: another run is using scenarios/; wait for it") \
            from None
    saved = {name: dest.read_bytes() for name, dest in SCENARIOS.items()}
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for capture, calibration, keys in PLAN:
                other = next(v for k, v in PROFILES.items() if k != calibration)
                use_profiles(PROFILES[calibration], keys, other, added)
                kind, source = CAPTURES[capture]
                rows.append({"captures": capture, "calibration": calibration,
                             "keys_from_the_other": list(keys),
                             **predict(kind, source, Path(tmp))})
                print({k: v for k, v in rows[-1].items() if k != "points"}, flush=True)
    finally:
        for name, dest in SCENARIOS.items():
            dest.write_bytes(saved[name])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    out.write_text(json.dumps(
        {"command": "uv run python reports/cross-machine/calibration_swap.py "
                    + " ".join(sys.argv[1:]), "code": commit, "added": added, "rows": rows},
        indent=1) + "\n")
    print("\n| captures | calibration | figures from the other | decode median | p90 | largest "
          "| components median |\n|---|---|---|---|---|---|---|")
    for r in rows:
        def pct(key: str, row: dict = r) -> str:
            return "-" if row[key] is None else f"{row[key]:.1f}%"
        print(f"| {r['captures']} | {r['calibration']} | "
              f"{', '.join(r['keys_from_the_other']) or '-'} | {pct('median_pct')} | "
              f"{pct('p90_pct')} | {pct('max_pct')} | {pct('components_median_pct')} |")


if __name__ == "__main__":
    main()
