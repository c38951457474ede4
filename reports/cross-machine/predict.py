"""Machine B (a second VM) predicted from machine A's profile: the held-out configurations of
B's `ssdmoe validate` run (b-validation/), replayed by `sim compare` (no refit) on five profiles.
A is this project's calibrated machine (scenarios/: this-machine and this-machine-tiny-trained);
B's own `ssdmoe calibrate` output and in-decode fits are in b-profiles/.

  A's profile          A's hardware, model and scenario profiles: nothing measured on B
  B's calibrate only   B's `ssdmoe calibrate` (isolated loops, one command: what a new user
                       has), its in-decode figures at their isolated values
  B's calibrate +      B's calibrate with A's [in_decode] fits
    A's fits
  A's hardware +       A's hardware and model profiles with B's [in_decode] fits
    B's fits
  B's profile          B's calibrate and in-decode fits (what B's `validate` reported)

Usage: uv run python reports/cross-machine/predict.py. Writes cross-machine.json and the
tables in README.md beside this script."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sim.compare import compare  # noqa: E402
from traces.reader import read_trace  # noqa: E402
from validation.decode_fits import write_fit  # noqa: E402
from validation.report import COMPONENTS  # noqa: E402

HERE = Path(__file__).resolve().parent
METRICS = ("decode_tok_s", *COMPONENTS)
A_SCENARIO = "scenarios/this-machine-tiny-trained.toml"
A_HARDWARE = "scenarios/hardware/this-machine.toml"
A_MODEL = "scenarios/models/tiny-trained.toml"
B = HERE / "b-profiles"
B_VALIDATION = HERE / "b-validation"
VARIANTS = {
    "a": "A's profile",
    "b_isolated": "B's calibrate only",
    "b_isolated+a_fits": "B's calibrate + A's fits",
    "a_hw+b_fits": "A's hardware + B's fits",
    "b": "B's profile",
}


def with_profiles(text: str, hardware: Path, model: Path) -> str:
    """A scenario's text with its hardware and model profiles replaced by these files."""
    text = re.sub(r'^hardware = ".*"', f'hardware = "{hardware}"', text, count=1, flags=re.M)
    return re.sub(r'^model = ".*"', f'model = "{model}"', text, count=1, flags=re.M)


def in_decode(text: str) -> str:
    """The scenario's [in_decode] table, header to the next table."""
    found = re.search(r"^\[in_decode\].*?(?=^\[|\Z)", text, flags=re.M | re.S)
    if found is None:
        raise SystemExit("predict.py: a scenario without an [in_decode] table")
    return found.group(0)


def stepwise_exact(scenario_text: str) -> float:
    """The exact path's per-decode-step figure that calibrate measured beside the one timed
    alone (a text note "build_ms_per_layer.exact_stepwise" of the calibrate that wrote it; what
    calibrate now starts the in-decode figure from)."""
    found = re.search(r'"build_ms_per_layer.exact_stepwise" = "([0-9.]+)"', scenario_text)
    if found is None:
        raise SystemExit("predict.py: the scenario has no exact_stepwise note")
    return float(found.group(1))


def calibrate_only(path: Path, text: str, validation: Path, exact: float | None) -> None:
    """Write `text` to `path` with every in-decode figure at calibrate's isolated value (the
    run's calibration-fit.json), and the exact path's at `exact` if given."""
    path.write_text(text)
    for key, fit in json.loads((validation / "calibration-fit.json").read_text()).items():
        write_fit(path, key, fit["before"], "isolated-loop figure")
    if exact is not None:
        write_fit(path, "build_ms_per_layer.exact", exact, "the exact path per decode step")


def held_out_errors(validation: Path, scenario: Path) -> dict[str, float]:
    """Decode tok/s median and p90 absolute error over a validate run's held-out
    configurations, replayed on `scenario`."""
    errs = []
    for f in sorted((validation / "results").glob("*.json")):
        result = json.loads(f.read_text())
        if result["config"]["role"] == "held-out":
            comp = compare(read_trace(REPO / result["trace"]), scenario=str(scenario))
            errs.append(ape(result["measured"]["decode_tok_s"],
                            comp.simulated["decode_tok_s"]))
    return error_summary(errs)


def error_summary(errs: list[float]) -> dict[str, float]:
    """Median and p90 of absolute errors (%), and how many."""
    return {"median_ape_pct": statistics.median(errs),
            "p90_ape_pct": float(np.percentile(errs, 90)), "n": len(errs)}


def exact_start(tmp: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Each machine's own matrix from its calibrate alone, the exact path's figure timed alone
    (as calibrate wrote it then) or per decode step (as it writes it now)."""
    a_sc, b_sc = (REPO / A_SCENARIO).read_text(), (B / "scenario.toml").read_text()
    machines = {"A": (with_profiles(a_sc, REPO / A_HARDWARE, REPO / A_MODEL),
                      REPO / "reports/validation"),
                "B": (with_profiles(b_sc, B / "hardware.toml", B / "model.toml"), B_VALIDATION)}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, (text, validation) in machines.items():
        out[name] = {}
        for start, exact in (("alone", None), ("per_step", stepwise_exact(text))):
            path = tmp / f"{name}-{start}.toml"
            calibrate_only(path, text, validation, exact)
            out[name][start] = held_out_errors(validation, path)
    return out


def scenarios(tmp: Path) -> dict[str, Path]:
    """A scenario file per variant: each names its hardware and model profiles by path."""
    a_hw, a_model, b_hw, b_model = (REPO / A_HARDWARE, REPO / A_MODEL, B / "hardware.toml",
                                    B / "model.toml")
    a_sc, b_sc = (REPO / A_SCENARIO).read_text(), (B / "scenario.toml").read_text()
    isolated = tmp / "isolated.toml"
    calibrate_only(isolated, with_profiles(b_sc, b_hw, b_model), B_VALIDATION, None)
    iso = isolated.read_text()
    texts = {"a": with_profiles(a_sc, a_hw, a_model),
             "b_isolated": iso,
             "b_isolated+a_fits": iso.replace(in_decode(iso), in_decode(a_sc)),
             "a_hw+b_fits": with_profiles(b_sc, a_hw, a_model),
             "b": with_profiles(b_sc, b_hw, b_model)}
    paths = {}
    for name, text in texts.items():
        paths[name] = tmp / f"{name.replace('+', '-')}.toml"
        paths[name].write_text(text)
    return paths


def ape(measured: float | None, simulated: float | None) -> float | None:
    if not measured or simulated is None:
        return None
    return abs(simulated - measured) / measured * 100


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        files = scenarios(Path(d))
        for f in sorted((B_VALIDATION / "results").glob("*.json")):
            result = json.loads(f.read_text())
            if result["config"]["role"] != "held-out":
                continue
            trace = read_trace(REPO / result["trace"])
            row = {"config": result["config"]["name"],
                   "measured": {k: result["measured"].get(k) for k in METRICS}}
            for name, path in files.items():
                comp = compare(trace, scenario=str(path))
                figures = {**comp.simulated, **comp.extra}
                row[name] = {k: figures.get(k) for k in METRICS}
            rows.append(row)
        starts = exact_start(Path(d))
    summary = {}
    for v in VARIANTS:
        summary[v] = {}
        for k in METRICS:
            errs = [e for r in rows if (e := ape(r["measured"][k], r[v][k])) is not None]
            summary[v][k] = error_summary(errs)
    doc = {"machine_a": A_HARDWARE, "machine_b": str(B.relative_to(REPO)),
           "variants": VARIANTS, "summary": summary, "rows": rows,
           "calibrate_only_exact_start": starts}
    (HERE / "cross-machine.json").write_text(json.dumps(doc, indent=1) + "\n")
    tables = render(rows, summary, starts)
    readme = HERE / "README.md"
    text = readme.read_text() if readme.is_file() else "<!-- tables -->\n<!-- /tables -->\n"
    text = re.sub(r"<!-- tables -->.*<!-- /tables -->", lambda _: tables, text, flags=re.S)
    readme.write_text(text)
    print(tables)


def render(rows: list[dict], summary: dict, starts: dict) -> str:
    names = list(VARIANTS)
    head = "| profile | decode tok/s median / p90 | build | eval | blocked |\n|---|---|---|---|---|"
    lines = ["<!-- tables -->", head]
    for v in names:
        s = summary[v]
        cells = [f"{s[k]['median_ape_pct']:.1f}% / {s[k]['p90_ape_pct']:.1f}%" for k in METRICS]
        lines.append(f"| {VARIANTS[v]} | " + " | ".join(cells) + " |")
    lines += ["", "Decode tok/s per held-out configuration, simulated against measured:", "",
              "| configuration | measured | " + " | ".join(VARIANTS[v] for v in names) + " |",
              "|---|---|" + "---|" * len(names)]
    for r in rows:
        m = r["measured"]["decode_tok_s"]
        cells = [f"{r[v]['decode_tok_s'] / m - 1:+.1%}" for v in names]
        lines.append(f"| `{r['config']}` | {m:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "Each machine's own held-out matrix from its `calibrate` alone, the exact path's "
              "figure timed alone (as calibrate wrote it before) or per decode step (as it "
              "writes it now), decode tok/s median / p90:", "",
              "| machine | timed alone | per decode step |", "|---|---|---|"]
    for name, by in starts.items():
        cells = [f"{by[k]['median_ape_pct']:.1f}% / {by[k]['p90_ape_pct']:.1f}%"
                 for k in ("alone", "per_step")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("<!-- /tables -->")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
