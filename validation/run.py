"""Run a validation matrix on this machine: calibrate, capture a trace per configuration (each
in its own `ssdmoe capture` process, so a throttle or a crash stays with its configuration),
and replay each through the simulator (`sim compare`). Resumable: a configuration whose trace
is complete and whose comparison is written is not run again; an interrupted run keeps what it
measured, and `missing()` says what is left. No MLX in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.errors import BadInput
from engine.bench import expert_files, warm_files  # MLX-free helpers
from traces.regime import DECODE_SEED, DECODE_TEMP
from traces.writer import write_json_atomic
from validation.matrix import PAGE_CACHE, Config

FIT_ROUNDS = 3
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "traces" / "prompts" / "default.jsonl"
# what is compared, per decode step unless named otherwise
METRICS = ("decode_tok_s", "step_ms_p50", "blocked_ms_per_step", "cold_fraction",
           "build_ms_per_step", "eval_ms_per_step")


@dataclass
class Plan:
    model: Path
    out: Path  # reports/validation (traces/<config>/ and results/<config>.json below it)
    prompts: int = 2
    max_tokens: int = 48
    heads: Path | None = None
    temp: float = DECODE_TEMP
    seed: int = DECODE_SEED

    def trace_dir(self, c: Config) -> Path:
        return self.out / "traces" / c.name

    def result_path(self, c: Config) -> Path:
        return self.out / "results" / f"{c.name}.json"


def done(plan: Plan, c: Config) -> bool:
    run = plan.trace_dir(c) / "run.json"
    if not plan.result_path(c).is_file() or not run.is_file():
        return False
    try:
        return bool(json.loads(run.read_text()).get("complete"))
    except (OSError, ValueError):
        return False


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


def capture(plan: Plan, c: Config, prompts: Path) -> None:
    out = plan.trace_dir(c)
    if PAGE_CACHE[c.page_cache] is None:  # configuration "all": every expert file cached
        warm_files(expert_files(plan.model))
    cmd = cli("capture", str(plan.model), "--out", str(out), "--force", "--no-progress",
              "--prompts", str(prompts), "--max-tokens", str(plan.max_tokens),
              "--temp", str(plan.temp), "--seed", str(plan.seed), *c.capture_args(plan.heads))
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ,
                                                                  "PYTHONUNBUFFERED": "1"})
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BadInput(f"validate: configuration {c.name}: capture failed: {last}")


def compare_one(plan: Plan, c: Config) -> dict[str, Any]:
    """Measured vs simulated for one captured configuration (sim compare with this machine's
    calibrated scenario), written to results/<config>.json."""
    from sim.compare import compare
    from traces.reader import read_trace

    trace_dir = plan.trace_dir(c)
    trace = read_trace(trace_dir)
    sim_dir = plan.out / "simulated" / c.name
    comp = compare(trace, out=sim_dir)
    measured = dict(comp.measured)
    simulated = dict(comp.simulated)
    measured["build_ms_per_step"] = comp.extra["measured_build_ms_per_step"]
    measured["eval_ms_per_step"] = comp.extra["measured_eval_ms_per_step"]
    simulated["build_ms_per_step"] = comp.extra["build_ms_per_step"]
    simulated["eval_ms_per_step"] = comp.extra["eval_ms_per_step"]
    result = {
        "config": c.to_dict(), "trace": str(trace_dir), "simulated_trace": str(sim_dir),
        "layers": (trace.run.get("model") or {}).get("layers"),
        "model_sha256": (trace.run.get("model") or {}).get("manifest_sha256"),
        "throttle": (trace.run.get("extra") or {}).get("throttle"),
        "measured": measured, "simulated": simulated,
        "ape_pct": {k: ape(measured.get(k), simulated.get(k)) for k in METRICS},
        "settings": comp.settings, "notes": comp.notes,
        "capture_command": trace.run.get("command"),
    }
    path = plan.result_path(c)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result, durable=False)
    return result


def ape(measured: float | None, simulated: float | None) -> float | None:
    """Absolute percentage error of `simulated` against `measured` (None when undefined)."""
    if measured is None or simulated is None or measured == 0:
        return None
    return abs(simulated - measured) / abs(measured) * 100.0


def run(plan: Plan, configs: list[Config],
        progress: Callable[[int, int, Config, str], None] | None = None,
        fit: Callable[[list[dict]], Any] | None = None) -> list[dict]:
    """Capture and compare every configuration not done yet; returns every result (old ones
    read back). The calibration configurations come first; then `fit(their results)` may
    update the profile, and they are compared again on it (in-sample) before any held-out
    one is predicted. A failed configuration is reported and the run goes on."""
    prompts = prompts_file(plan)
    cal = [c for c in configs if c.role == "calibration"]
    held = [c for c in configs if c.role != "calibration"]
    cal_results = _run(plan, cal, prompts, progress, 0, len(configs))
    # The fit is repeated: with the host's cores shared (sim.cpu), a path's simulated build
    # time is not linear in its CPU figure, so one correction step lands near, not on, it.
    for _ in range(FIT_ROUNDS if fit is not None and cal_results else 0):
        fit(cal_results)
        cal_results = [compare_one(plan, Config(**{k: v for k, v in r["config"].items()
                                                   if k != "name"}))
                       for r in cal_results]
    return cal_results + _run(plan, held, prompts, progress, len(cal), len(configs))


def _run(plan: Plan, configs: list[Config], prompts: Path,
         progress: Callable[[int, int, Config, str], None] | None, first: int,
         todo: int) -> list[dict]:
    results = []
    for i, c in enumerate(configs, first + 1):
        if done(plan, c):
            if progress:
                progress(i, todo, c, "kept (already measured)")
            results.append(json.loads(plan.result_path(c).read_text()))
            continue
        t0 = time.perf_counter()
        if progress:
            progress(i, todo, c, "capturing")
        try:
            capture(plan, c, prompts)
            results.append(compare_one(plan, c))
        except BadInput as err:
            if progress:
                progress(i, todo, c, f"FAILED: {err}")
            continue
        if progress:
            progress(i, todo, c, f"done in {time.perf_counter() - t0:.0f} s")
    return results
