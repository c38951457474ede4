"""A committed `validate` run's held-out configurations predicted again by this checkout: each
median-round trace replayed by `sim compare` on the run's own committed profiles, no refit,
against the rounds' measured medians (results/*.json). For a change to the simulator, on a
machine that is not this one: run it on two checkouts and compare.

Usage: uv run python reports/cross-machine/repredict.py [RUN]  (default: b-validation-7)."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from reports.load_script import load_script  # noqa: E402
from sim.compare import compare, measured_split  # noqa: E402
from traces.reader import read_trace  # noqa: E402

FIGURES = ("decode_tok_s", "blocked_ms_per_step", "build_ms_per_step", "eval_ms_per_step")


def scenario_file(profiles: Path, tmp: Path) -> str:
    """The scenario TOML of a committed run's profiles/ (token-lead's helper), written under tmp."""
    return load_script("io/token-lead/run.py").scenario_file(profiles, tmp)


def simulated_figures(trace_dir: Path, scenario: str, out: Path) -> dict:
    """`sim compare`'s figures of the trace, with build and eval per decode step."""
    res = compare(read_trace(trace_dir), scenario=scenario, out=out)
    split = measured_split(read_trace(out))  # read off the simulated trace, as off a measured one
    return dict(res.simulated, build_ms_per_step=split["build_ms_per_step"],
                eval_ms_per_step=split["eval_ms_per_step"])


def errors(pairs: list[tuple[dict, dict]]) -> dict:
    """Median and p90 (validation.report's percentile) absolute % error of each figure."""
    out = {}
    for key in FIGURES:
        ape = [abs(s[key] / m[key] - 1) * 100 for m, s in pairs if m.get(key)]
        out[key] = {"median_pct": statistics.median(ape),
                    "p90_pct": float(np.percentile(ape, 90))}
    return out


def main() -> None:
    run = HERE / (sys.argv[1] if len(sys.argv) > 1 else "b-validation-7")
    if not (run / "profiles" / "scenario.toml").is_file() or not (run / "results").is_dir():
        raise SystemExit(f"repredict.py: {run}: not a committed validate run with profiles/")
    pairs, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        scenario = scenario_file((run / "profiles").resolve(), Path(tmp))
        for f in sorted((run / "results").glob("*.json")):
            d = json.loads(f.read_text())
            if d["config"]["role"] != "held-out":
                continue
            sim = simulated_figures(ROOT / d["trace"], scenario, Path(tmp) / "sim")
            pairs.append((d["measured"], sim))
            rows.append((d["config"]["name"], d["measured"]["decode_tok_s"],
                         sim["decode_tok_s"]))
    for name, m, s in rows:
        print(f"{name:36s} measured {m:7.1f}  simulated {s:7.1f}  {100 * (s / m - 1):+6.1f}%")
    for key, e in errors(pairs).items():
        print(f"{key:20s} median {e['median_pct']:5.1f}%  p90 {e['p90_pct']:5.1f}%")


if __name__ == "__main__":
    main()
