"""Run a validation matrix on this machine: calibrate, capture a trace per configuration (each
in its own `ssdmoe capture` process, so a throttle or a crash stays with its configuration),
and replay each through the simulator (`sim compare`). With rounds > 1 every configuration is
captured once per round, the order rotated from round to round (this machine is shared and
noisy: a configuration can run 30% slower in one capture than in the next): each measured
figure is then its median over the rounds, and the round with the median decode tok/s is the
one replayed. Resumable: a configuration whose traces are complete and whose comparison is
written is not run again; an interrupted run keeps what it measured, and `missing()` says
what is left. No MLX in this process."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import BadInput
from contract.thresholds import PAGE_CACHE_SHARES
from engine.bench.benchmark import expert_files, warm_files  # MLX-free helpers
from traces.regime import DECODE_SEED, DECODE_TEMP
from traces.writer import write_json_atomic
from validation.matrix import Config

FIT_ROUNDS = 3
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "traces" / "prompts" / "default.jsonl"
# what is compared, per decode step unless named otherwise
METRICS = ("decode_tok_s", "step_ms_p50", "blocked_ms_per_step", "cold_fraction",
           "build_ms_per_step", "eval_ms_per_step")
# sim.compare.measured_split's figures, read off the measured and the simulated trace alike
SPLIT = ("build_ms_per_step", "eval_ms_per_step", "reader_waits_per_step", "reader_start_ms",
         "build_per_cold_read_ms", "cold_read_ms", "blocked_past_loads_ms")


@dataclass
class Plan:
    model: Path
    out: Path  # reports/validation (traces/<config>/ and results/<config>.json below it)
    prompts: int = 2
    max_tokens: int = 48
    heads: Path | None = None
    temp: float = DECODE_TEMP
    seed: int = DECODE_SEED
    rounds: int = 1
    # every capture on this emulated machine: MachineLimits.flags() (--mem-limit, --cpus, ...)
    machine: list[str] = field(default_factory=list)

    def trace_dir(self, c: Config, round_: int = 0) -> Path:
        name = c.name if round_ == 0 else f"{c.name}.r{round_}"
        return self.out / "traces" / name

    def result_path(self, c: Config) -> Path:
        return self.out / "results" / f"{c.name}.json"


def captured(plan: Plan, c: Config, round_: int) -> bool:
    run = plan.trace_dir(c, round_) / "run.json"
    try:
        return run.is_file() and bool(json.loads(run.read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def captured_all(plan: Plan, c: Config) -> bool:
    return all(captured(plan, c, r) for r in range(plan.rounds))


def done(plan: Plan, c: Config) -> bool:
    return plan.result_path(c).is_file() and captured_all(plan, c)


def missing(plan: Plan, configs: list[Config]) -> list[Config]:
    return [c for c in configs if not done(plan, c)]


def measured(plan: Plan, configs: list[Config]) -> list[dict]:
    """The results already written (what an interrupted run keeps)."""
    return [json.loads(plan.result_path(c).read_text()) for c in configs if done(plan, c)]


def prompts_file(plan: Plan) -> Path:
    lines = [ln for ln in DEFAULT_PROMPTS.read_text().splitlines() if ln.strip()]
    if len(lines) < plan.prompts:
        raise BadInput(f"{DEFAULT_PROMPTS}: {len(lines)} prompts, validate needs {plan.prompts}")
    f = plan.out / "prompts.jsonl"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("\n".join(lines[: plan.prompts]) + "\n")
    return f


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ssdmoe_cli", *args]


def capture(plan: Plan, c: Config, prompts: Path, round_: int = 0) -> None:
    out = plan.trace_dir(c, round_)
    if PAGE_CACHE_SHARES[c.page_cache] is None and "--mem-limit" not in plan.machine:
        warm_files(expert_files(plan.model))  # "all": every expert file cached
    cmd = cli("capture", str(plan.model), "--out", str(out), "--force", "--no-progress",
              "--prompts", str(prompts), "--max-tokens", str(plan.max_tokens),
              "--temp", str(plan.temp), "--seed", str(plan.seed), *c.capture_args(plan.heads),
              *plan.machine)
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ,
                                                                  "PYTHONUNBUFFERED": "1"})
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BadInput(f"validate: configuration {c.name}: capture failed: {last}")


def round_figures(plan: Plan, c: Config) -> dict[int, dict[str, Any]]:
    """What each captured round of `c` measured (its summary and sim.compare.measured_split),
    by round."""
    from sim.compare import measured_split
    from traces.reader import read_trace
    from traces.summary import summarize

    out = {}
    for r in range(plan.rounds):
        if captured(plan, c, r):
            trace = read_trace(plan.trace_dir(c, r))
            out[r] = {**summarize(trace), **measured_split(trace)}
    return out


def median_round(figures: dict[int, dict[str, Any]]) -> int:
    """The round with the median decode tok/s (the lower middle of an even count)."""
    order = sorted(figures, key=lambda r: (figures[r]["decode_tok_s"] or 0.0, r))
    return order[(len(order) - 1) // 2]


def median_figures(figures: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds, on its own: on a shared machine a slow spell can
    stretch one round's build and another's blocked time, and one round's components are then
    no better an estimate than one capture's (None where no round has the figure)."""
    keys = dict.fromkeys(k for f in figures.values() for k in f)  # first seen, in order
    out = {}
    for k in keys:
        values = [f[k] for f in figures.values() if isinstance(f.get(k), (int, float))]
        out[k] = statistics.median(values) if values else None
    return out


def compare_one(plan: Plan, c: Config) -> dict[str, Any]:
    """Measured vs simulated for one captured configuration (sim compare with this machine's
    calibrated scenario), written to results/<config>.json. With several rounds the measured
    figures are each the median over the rounds, and the simulator replays the round with the
    median decode tok/s (the rounds route alike: decoding is seeded)."""
    from sim.compare import compare
    from traces.reader import read_trace

    figures = round_figures(plan, c)
    chosen = median_round(figures)
    trace_dir = plan.trace_dir(c, chosen)
    trace = read_trace(trace_dir)
    sim_dir = plan.out / "simulated" / c.name
    comp = compare(trace, out=sim_dir)
    measured = median_figures(figures)  # one round: that round's figures
    simulated = {**comp.simulated, **{k: comp.extra[k] for k in SPLIT}}
    result = {
        "config": c.to_dict(), "trace": str(trace_dir), "simulated_trace": str(sim_dir),
        "layers": (trace.run.get("model") or {}).get("layers"),
        "heads": heads_of(trace),
        "model_sha256": (trace.run.get("model") or {}).get("manifest_sha256"),
        "throttle": (trace.run.get("extra") or {}).get("throttle"),
        "measured": measured, "simulated": simulated,
        "ape_pct": {k: ape(measured.get(k), simulated.get(k)) for k in METRICS},
        "settings": comp.settings, "notes": comp.notes,
        "capture_command": trace.run.get("command"),
        "rounds_decode_tok_s": [figures[r]["decode_tok_s"] for r in sorted(figures)]
        if plan.rounds > 1 else [],
        "rounds_measured": {k: [figures[r].get(k) for r in sorted(figures)]
                            for k in dict.fromkeys((*METRICS, *SPLIT))}
        if plan.rounds > 1 else {},
        "compared_round": chosen,
    }
    path = plan.result_path(c)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result, durable=False)
    return result


def heads_of(trace) -> int:
    """Prediction heads the trace's engine ran per step (0 without a prerouter)."""
    from sim.model_profile import heads_profile

    where = (trace.run.get("engine") or {}).get("prerouter")
    return int(heads_profile(Path(str(where)) / "prerouter.json")["heads"][0]) if where else 0


def ape(measured: float | None, simulated: float | None) -> float | None:
    """Absolute percentage error of `simulated` against `measured` (None when undefined)."""
    if measured is None or simulated is None or measured == 0:
        return None
    return abs(simulated - measured) / abs(measured) * 100.0


def run(plan: Plan, configs: list[Config],
        progress: Callable[[int, int, Config, str], None] | None = None,
        fit: Callable[[list[dict]], Any] | None = None) -> list[dict]:
    """Capture and compare every configuration not done yet; returns every result (old ones
    read back). Every round captures every configuration, calibration and held-out alike, in
    one rotated order: on a shared machine a slow spell then falls on all of them instead of
    on the subset the fit comes from. Then `fit(the calibration results)` may update the
    profile, they are compared again on it (in-sample), and only then is every held-out one
    predicted on the fitted profile. A failed configuration is reported and the run goes on."""
    prompts = prompts_file(plan)
    results = _run(plan, configs, prompts, progress, 0, len(configs))
    cal_results = [r for r in results if r["config"]["role"] == "calibration"]
    held = [r for r in results if r["config"]["role"] != "calibration"]
    if fit is None or not cal_results:
        return results
    # The fit is repeated: with the host's cores shared (sim.cpu), a path's simulated build
    # time is not linear in its CPU figure, so one correction step lands near, not on, it.
    for _ in range(FIT_ROUNDS):
        fit(cal_results)
        cal_results = [compare_one(plan, _config(r)) for r in cal_results]
    return cal_results + [compare_one(plan, _config(r)) for r in held]


def _config(result: dict) -> Config:
    return Config(**{k: v for k, v in result["config"].items() if k != "name"})


def _run(plan: Plan, configs: list[Config], prompts: Path,
         progress: Callable[[int, int, Config, str], None] | None, first: int,
         todo: int) -> list[dict]:
    """Capture every round of `configs` (rounds rotate the order); a configuration is compared
    as soon as its last round is captured, so an interrupted run keeps its comparisons."""
    index = {c.name: i for i, c in enumerate(configs, first + 1)}
    failed: set[str] = set()
    results: dict[str, dict] = {}
    for r in range(plan.rounds):
        shift = r % len(configs) if configs else 0
        for c in configs[shift:] + configs[:shift]:
            i = index[c.name]
            if c.name in failed or c.name in results:
                continue
            if done(plan, c):
                if progress:
                    progress(i, todo, c, "kept (already measured)")
                results[c.name] = json.loads(plan.result_path(c).read_text())
                continue
            fresh = not captured(plan, c, r)  # else captured before an interruption
            t0 = time.perf_counter()
            if fresh:
                label = ("capturing" if plan.rounds == 1
                         else f"capturing round {r + 1}/{plan.rounds}")
                if progress:
                    progress(i, todo, c, label)
                try:
                    capture(plan, c, prompts, r)
                except BadInput as err:
                    failed.add(c.name)
                    if progress:
                        progress(i, todo, c, f"FAILED: {err}")
                    continue
            if captured_all(plan, c):  # compared before "done": an interruption keeps it
                results[c.name] = compare_one(plan, c)
            if fresh and progress:
                progress(i, todo, c, f"done in {time.perf_counter() - t0:.0f} s")
    return [results[c.name] for c in configs if c.name in results]
