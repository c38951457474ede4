"""When the token lead's reads start, and where its decode step still waits: measured, and
replayed by the simulator (this checkout's, and with --before-code another checkout's).

The prerouter's heads predict step t+1's experts of every consumer layer during step t; the
engine reads them once the predicted ids are on the host (engine.fill_points.begin). This
captures the staged preset with the heads (sampled decoding, 4 prompts x 96 tokens) at a
page-cache budget of 1/4 of the expert bytes and with every expert cached, unthrottled, the
regimes' order rotated over rounds, and reports for each trace:

  issue lead   how long before step t+1's first router (its first on-demand load, in the
               first MoE layer, which no head predicts) step t+1's predicted reads start
               (median over decode steps; from the trace's load rows)
  blocked      the main thread's wait on loads per decode step, split by layer: the first
               MoE layer has no head above it, so its experts are read on demand after its
               own router, every step
  cold/step    cold loads per decode step of each layer

beside the same figures of each trace replayed by `sim compare` on one profile (no refit).

Usage: uv run python reports/io/token-lead/run.py [--rounds 3] [--profiles DIR]
[--before-code DIR]. --profiles: a folder with hardware.toml, model.toml and scenario.toml
(a validate run's `profiles/`; default: the committed this-machine-tiny-trained scenario).
Writes token-lead.json and the table in README.md beside this script; traces in runs/."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

import polars as pl  # noqa: E402

from engine.child_env import importing  # noqa: E402
from sim.compare import compare  # noqa: E402
from traces.reader import Trace, read_trace  # noqa: E402
from traces.summary import summarize, summarize_layers  # noqa: E402

MODEL = ROOT / "models" / "tiny-trained-stream"
PROMPTS = ROOT / "reports" / "validation" / "prompts.jsonl"
REGIMES = {"quarter": ["--page-cache-fraction", "0.25"], "all": []}
RUNS = ROOT / "runs" / "token-lead"


def capture(model: Path, regime: str, out: Path, extra: tuple[str, ...] = ()) -> None:
    cmd = ["uv", "run", "ssdmoe", "capture", str(model), "--out", str(out), "--force",
           "--no-progress", "--prompts", str(PROMPTS), "--max-tokens", "96", "--temp", "1.0",
           "--seed", "0", "--preset", "staged", "--prerouter", str(model / "prerouter"),
           *REGIMES[regime], *extra]
    run(cmd, cwd=ROOT)


def lead_figures(trace: Trace) -> dict:
    """Decode tok/s and blocked ms/step (traces.summary), the main thread's wait and the cold
    loads per decode step by layer (traces.summary.summarize_layers), and the issue lead: how
    long before a decode step's first on-demand load its first prefetch was issued (median)."""
    summary, layers = summarize(trace), summarize_layers(trace).filter(pl.col("loads") > 0)
    steps = trace.steps.filter(pl.col("phase") == "decode")["step"]
    first = trace.loads.filter(pl.col("step").is_in(steps.implode()) & (pl.col("expert") >= 0)
                               ).group_by("step", pl.col("source") == "prefetch").agg(
        pl.col("issued_ns").min())
    demand = dict(first.filter(~pl.col("source")).select("step", "issued_ns").iter_rows())
    leads = [(demand[s] - issued) / 1e6 for s, issued in
             first.filter(pl.col("source")).select("step", "issued_ns").iter_rows()
             if s in demand]
    cold = layers["loads_per_step"] * layers["cold_fraction"]
    return {"decode_tok_s": summary["decode_tok_s"],
            "blocked_ms_per_step": summary["blocked_ms_per_step"],
            "blocked_ms_by_layer": dict(zip(layers["layer"].to_list(),
                                            layers["wait_ms_per_step"].to_list(), strict=True)),
            "cold_loads_by_layer": dict(zip(layers["layer"].to_list(), cold.to_list(),
                                            strict=True)),
            "issue_lead_ms": statistics.median(leads) if leads else None}


def scenario_file(profiles: Path | None, tmp: Path, model: Path | None = None) -> str | None:
    """A scenario path for `sim compare`: the folder's scenario with its hardware and model
    profiles pointed at the folder's files (a file any checkout's `sim compare` reads), or at
    `model` for the model profile; None: the committed scenario."""
    if profiles is None:
        return None
    text = (profiles / "scenario.toml").read_text()
    for key, path in (("hardware", profiles / "hardware.toml"),
                      ("model", model or profiles / "model.toml")):
        text = re.sub(rf'^{key} = ".*"', f'{key} = "{path}"', text, count=1, flags=re.M)
    path = tmp / "scenario.toml"
    path.write_text(text)
    return str(path)


def simulated(trace_dir: Path, scenario: str | None, out: Path,
              code: Path | None = None) -> dict:
    """The trace replayed by this checkout's simulator, or by `code`'s (a subprocess that
    imports that checkout), read back from the simulated trace."""
    if code is None:
        compare(read_trace(trace_dir), scenario=scenario, out=out)
    else:
        cmd = [sys.executable, "-m", "ssdmoe_cli", "sim", "compare", str(trace_dir),
               "--out", str(out), *(["--scenario", scenario] if scenario else [])]
        run(cmd, cwd=code, env=importing(code))
    return lead_figures(read_trace(out))


def run(cmd: list[str], **kw) -> None:
    """Run a command; its failure ends this script in one line with the command's last words."""
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise SystemExit(f"run.py: `{' '.join(cmd[:4])} ...` failed: {tail[0]}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _row(regime: str, label: str, f: dict) -> str:
    layers = sorted(f["blocked_ms_by_layer"])
    first = f["blocked_ms_by_layer"][layers[0]]
    return (f"| {regime} | {label} | {f['decode_tok_s']:.1f} | {_ms(f['issue_lead_ms'])} | "
            f"{f['blocked_ms_per_step']:.2f} | {first:.2f} | "
            f"{f['blocked_ms_per_step'] - first:.2f} | "
            f"{f['cold_loads_by_layer'][layers[0]]:.2f} |")


def table(results: dict) -> str:
    lines = ["| regime | figures | decode tok/s | issue lead ms | blocked ms/step | of it, first "
             "layer | other layers | first layer's cold loads/step |",
             "|---|---|---|---|---|---|---|---|"]
    for regime, rec in results["regimes"].items():
        for label in ("measured", "simulated", "simulated_before"):
            if label in rec["median"]:
                lines.append(_row(regime, label.replace("_", ", "), rec["median"][label]))
    return "\n".join(lines)


def median_figures(rows: list[dict]) -> dict:
    """Each figure's median over rounds (per layer for the by-layer ones); None where no
    round has it."""
    def median(values) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    out = {}
    for key in rows[0]:
        if isinstance(rows[0][key], dict):
            out[key] = {k: median(r[key].get(k) for r in rows) for k in rows[0][key]}
        else:
            out[key] = median(r[key] for r in rows)
    return out


def commit() -> str:
    """This checkout's short commit, as the reports' JSON names it."""
    return subprocess.run(["git", "rev-parse", "--short=8", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()


def replay_arguments(doc: str, name: str) -> argparse.Namespace:
    """The options of a report that captures arms of one model and replays each trace on one
    profile (--rounds, --model, --profiles, --model-profile, --tag), checked; `name` is the
    report's JSON name."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--profiles", type=Path, default=None)
    ap.add_argument("--model-profile", type=Path, default=None,
                    help="the model profile to replay with (default: the --profiles folder's)")
    ap.add_argument("--tag", default="",
                    help=f"name of this run's JSON ({name}-TAG.json) and README table")
    args = ap.parse_args()
    check_rounds_and_profiles(args.rounds, args.profiles)
    return args


def replay_header(script: str, args: argparse.Namespace, first_trace: Path) -> dict:
    """What the JSON of a report run with `replay_arguments` says of its run: the command,
    date, commit, profiles, model, and the model's manifest sha as its first trace records it."""
    return {
        "command": f"uv run python reports/io/{script}/run.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
        "profiles": str(args.profiles) if args.profiles else "scenarios/this-machine-tiny-trained",
        "model_profile": str(args.model_profile) if args.model_profile else None,
        "model": str(args.model),
        "manifest_sha256": read_trace(first_trace).run["model"]["manifest_sha256"]}


def check_rounds_and_profiles(rounds: int, profiles: Path | None) -> None:
    """--rounds and --profiles checked, in one line each."""
    if rounds < 1:
        raise SystemExit("run.py: --rounds must be at least 1")
    for name in ("hardware.toml", "model.toml", "scenario.toml"):
        if profiles is not None and not (profiles / name).is_file():
            raise SystemExit(f"run.py: {profiles / name}: no such profile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--profiles", type=Path, default=None)
    ap.add_argument("--before-code", type=Path, default=None)
    args = ap.parse_args()
    check_rounds_and_profiles(args.rounds, args.profiles)
    if args.before_code is not None and not (args.before_code / "sim").is_dir():
        raise SystemExit(f"run.py: {args.before_code}: not a checkout of this project")
    if not (args.model / "prerouter").is_dir():
        raise SystemExit(f"run.py: {args.model / 'prerouter'}: no prerouter heads (ssdmoe "
                         "train heads)")
    regimes = list(REGIMES)
    rows: dict[str, dict[str, list]] = {r: {} for r in regimes}
    with tempfile.TemporaryDirectory() as tmp:
        scenario = scenario_file(args.profiles.resolve() if args.profiles else None, Path(tmp))
        for rnd in range(args.rounds):
            for regime in regimes[rnd % 2:] + regimes[:rnd % 2]:
                trace_dir = RUNS / f"{regime}.r{rnd}"
                capture(args.model, regime, trace_dir)
                got = {"measured": lead_figures(read_trace(trace_dir)),
                       "simulated": simulated(trace_dir, scenario, Path(tmp) / "sim")}
                if args.before_code is not None:
                    got["simulated_before"] = simulated(trace_dir, scenario,
                                                        Path(tmp) / "before",
                                                        args.before_code.resolve())
                for label, figures in got.items():
                    rows[regime].setdefault(label, []).append(figures)
                print(f"{regime} round {rnd}: measured {got['measured']['decode_tok_s']:.1f} "
                      f"tok/s, issue lead {_ms(got['measured']['issue_lead_ms'])} ms; simulated "
                      f"{got['simulated']['decode_tok_s']:.1f}, "
                      f"{_ms(got['simulated']['issue_lead_ms'])} ms", flush=True)
    results = {
        "command": "uv run python reports/io/token-lead/run.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
        "before_code": str(args.before_code) if args.before_code else None,
        "profiles": str(args.profiles) if args.profiles else "scenarios/this-machine-tiny-trained",
        "model": str(args.model),
        "manifest_sha256": read_trace(RUNS / f"{regimes[0]}.r0").run["model"]["manifest_sha256"],
        "regimes": {r: {"rounds": rows[r], "median": {k: median_figures(v)
                                                       for k, v in rows[r].items()}}
                    for r in regimes}}
    publish(results, table(results), HERE / "token-lead.json", HERE / "README.md")


def publish(results: dict, md: str, json_path: Path, readme: Path, tag: str = "") -> None:
    """Write the JSON, print the table and put it between the README's table markers (those
    of `tag`, when given)."""
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    print(md)
    if readme.is_file():
        text = readme.read_text()
        start = f"<!-- table: run.py{' ' + tag if tag else ''} -->"
        end = "<!-- /table -->"
        if start in text and end in text:
            head, rest = text.split(start, 1)
            readme.write_text(head + start + "\n" + md + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    main()
