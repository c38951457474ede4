"""Sweeps: one base scenario, a few axes (key -> values, cartesian product) and optional seeds,
run in parallel worker processes; results as one Parquet row per point and one PNG per axis.

A grid file (scenarios/grids/*.toml):

    name = "m2-ram"                       # optional; default: the file's stem
    scenario = "paper-m2-16gb"            # base scenario (name or path)
    description = "..."
    set = ["decode_steps=300"]            # optional fixed overrides for every point
    trace = "traces/samples/x"            # optional: replay this trace's routing at every point
    metric = "decode_tok_s"               # optional: the plotted metric (a SUMMARY_KEY)
    seeds = [0, 1, 2]                     # optional: every point runs once per seed
    [axes]                                # key -> list of values, in plot order
    ram_gib = [8, 16, 24, 32]
    lead = ["none", "token"]
    [hold]                                # optional: other axes' value in each axis's plot
    ram_gib = 16

Keys are the `--set` keys of `sim run` (scenario, hardware or model keys; `hardware.X` /
`model.X` to be explicit). A point that fails (bad value, RAM below the resident weights, ...)
does not stop the sweep: its row has status "failed" and the reason in `error`. Problems with
the grid itself (unknown key, no axes, bad base scenario) are one-line BadInput errors.

Workers are spawned (not forked: polars keeps threads, and spawn is what macOS does anyway), each
point is a plain function call on picklable arguments (`run_point`). No MLX anywhere here.
"""

from __future__ import annotations

import itertools
import os
import typing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from contract.errors import BadInput
from sim.scenario import HARDWARE_KEYS, MODEL_KEYS, SCENARIO_KEYS, Hardware, ModelProfile, Scenario
from traces.schema import SUMMARY_KEYS

GRID_KEYS = {"name", "scenario", "description", "set", "trace", "metric", "seeds", "axes", "hold"}
# sim figures kept per point next to the SUMMARY_KEYS (names as in `sim run --json`)
EXTRA_KEYS = ("page_cache_bytes", "peak_engine_bytes", "page_cache_hit_rate", "lru_hit_rate",
              "device_busy_fraction", "build_ms_per_step", "eval_ms_per_step", "sim_steps_per_s",
              "sim_wall_s")
STATUS_OK, STATUS_FAILED = "ok", "failed"


@dataclass
class Grid:
    name: str
    scenario: str
    axes: dict[str, list[Any]]  # key -> values (as written in the grid file)
    seeds: list[int] | None = None
    sets: list[str] = field(default_factory=list)
    trace: str | None = None
    metric: str = "decode_tok_s"
    hold: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    source: str = ""

    def points(self) -> list[dict[str, Any]]:
        """Every combination of axis values (first axis slowest), then each seed."""
        keys = list(self.axes)
        out = []
        for combo in itertools.product(*(self.axes[k] for k in keys)):
            point = dict(zip(keys, combo, strict=True))
            for seed in self.seeds if self.seeds is not None else [None]:
                out.append(point if seed is None else {**point, "seed": seed})
        return out


def field_type(key: str) -> Any:
    """The dataclass type of a `--set` key (bare keys: scenario, then hardware, then model)."""
    section, _, name = key.rpartition(".")
    tables = {"scenario": (Scenario, SCENARIO_KEYS), "hardware": (Hardware, HARDWARE_KEYS),
              "model": (ModelProfile, MODEL_KEYS)}
    order = [section] if section else ["scenario", "hardware", "model"]
    for sec in order:
        if sec in tables and name in tables[sec][1]:
            return typing.get_type_hints(tables[sec][0])[name]
    return None


def set_text(value: Any) -> str:
    """A grid value as `--set` text (TOML booleans become true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def resolved(key: str, value: Any) -> Any:
    """The value as the simulator will read it (sizes like "1GiB" -> bytes); the raw text when
    it does not parse (that point will fail and say why)."""
    from sim.profiles import parse_text

    typ = field_type(key)
    try:
        return parse_text("grid", key.rpartition(".")[2], set_text(value), typ)
    except BadInput:
        return set_text(value)


def load_grid(path: str | Path) -> Grid:
    from sim.profiles import read_toml

    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: no such grid file")
    data = read_toml(path)
    where = str(path)
    for key in data:
        if key not in GRID_KEYS:
            raise BadInput(f"{where}: {key}: unknown key (known: {', '.join(sorted(GRID_KEYS))})")
    if not isinstance(data.get("scenario"), str):
        raise BadInput(f"{where}: scenario: missing (name of a scenarios/*.toml base scenario)")
    axes = data.get("axes")
    if not isinstance(axes, dict) or not axes:
        raise BadInput(f"{where}: axes: missing (a table key = [values, ...])")
    for key, values in axes.items():
        if key == "seed":
            raise BadInput(f"{where}: axes.seed: use the top-level `seeds = [...]` list")
        if field_type(key) is None:
            raise BadInput(f"{where}: axes.{key}: unknown key (a scenario, hardware or model key)")
        if not isinstance(values, list) or not values:
            raise BadInput(f"{where}: axes.{key}: expected a non-empty list of values")
    seeds = data.get("seeds")
    if seeds is not None and (not isinstance(seeds, list) or not seeds or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise BadInput(f"{where}: seeds: expected a non-empty list of integers >= 0")
    sets = data.get("set", [])
    if not isinstance(sets, list) or not all(isinstance(s, str) and "=" in s for s in sets):
        raise BadInput(f"{where}: set: expected a list of \"key=value\" strings")
    metric = data.get("metric", "decode_tok_s")
    if metric not in SUMMARY_KEYS and metric not in EXTRA_KEYS:
        raise BadInput(f"{where}: metric: {metric!r} is not a summary metric "
                       f"({', '.join(SUMMARY_KEYS)})")
    hold = data.get("hold", {})
    if not isinstance(hold, dict) or any(k not in axes for k in hold):
        raise BadInput(f"{where}: hold: expected a table of axis keys (axes: {', '.join(axes)})")
    trace = data.get("trace")
    if trace is not None and not isinstance(trace, str):
        raise BadInput(f"{where}: trace: expected a trace directory (string)")
    return Grid(name=str(data.get("name", path.stem)), scenario=data["scenario"], axes=axes,
                seeds=seeds, sets=list(sets), trace=trace, metric=metric, hold=hold,
                description=str(data.get("description", "")), source=where)


def check_grid(grid: Grid) -> None:
    """Fail fast on a bad base scenario, fixed overrides or trace (problems of the whole grid)."""
    from sim.profiles import load_scenario

    load_scenario(grid.scenario, grid.sets)
    if grid.trace is not None:
        from traces.reader import read_run

        read_run(Path(grid.trace))


def one_line(err: BaseException) -> str:
    """A failure as one line: BadInput's own message, else `Type: first line`."""
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else ""
    if isinstance(err, BadInput):
        return first or "bad input"
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def run_point(scenario: str, sets: list[str], trace: str | None) -> dict[str, Any]:
    """One point, in a worker: the metrics row, or status "failed" with a one-line reason."""
    try:
        from sim.profiles import load_scenario

        sc = load_scenario(scenario, sets)
    except Exception as err:  # noqa: BLE001 - any failure is this point's, reported as data
        return {"status": STATUS_FAILED, "error": one_line(err)}
    return run_scenario_point(sc, trace)


def run_scenario_point(sc: Scenario, trace: str | None = None) -> dict[str, Any]:
    """A built scenario as one point (the row `run_point` gives; ssdmoe advise's candidates)."""
    try:
        from sim.replay import run_scenario

        measured = None
        if trace is not None:
            from traces.reader import read_trace

            measured = read_trace(trace)
        result = run_scenario(sc, trace=measured)
    except Exception as err:  # noqa: BLE001 - any failure is this point's, reported as data
        return {"status": STATUS_FAILED, "error": one_line(err)}
    e = result.figures
    row: dict[str, Any] = {"status": STATUS_OK, "error": None, **result.metrics}
    row.update({
        "page_cache_bytes": e.page_cache_capacity_bytes,
        "peak_engine_bytes": e.memory["engine"],
        "page_cache_hit_rate": e.page_cache_hit_rate,
        "lru_hit_rate": e.lru_hit_rate,
        "device_busy_fraction": e.device_busy_fraction,
        "build_ms_per_step": e.build_ms_per_step,
        "eval_ms_per_step": e.eval_ms_per_step,
        "sim_steps_per_s": e.sim_steps_per_s,
        "sim_wall_s": e.sim_wall_s,
        "warnings": "; ".join(e.warnings) or None,
    })
    return row


def point_sets(grid: Grid, point: dict[str, Any]) -> list[str]:
    return grid.sets + [f"{k}={set_text(v)}" for k, v in point.items()]


BACKENDS = ("local", "ray")


def run_calls(point: Callable[..., dict[str, Any]], args: list[tuple],
              workers: int | None = None, progress: Callable[[int, int], None] | None = None,
              backend: str = "local", address: str | None = None) -> list[dict[str, Any]]:
    """point(*a) for every a in `args`, in parallel; rows in the order of `args` (a point that
    raised or whose worker died: status "failed"). `progress(done, total)` as points finish.
    workers=1 runs in-process; backend "ray" runs them as Ray tasks (sim.sweep_ray; `address`:
    a cluster to join)."""
    if backend not in BACKENDS:
        raise BadInput(f"--backend {backend}: unknown backend (one of {', '.join(BACKENDS)})")
    total = len(args)
    if backend == "ray":
        from sim.sweep_ray import run_points

        return list(run_points(args, point, one_line, address, progress))
    results: list[dict[str, Any]] = [{}] * total
    workers = max(1, min(workers or os.cpu_count() or 1, total))
    if workers == 1:
        for i, a in enumerate(args):
            results[i] = point(*a)
            if progress:
                progress(i + 1, total)
        return results
    saved = os.environ.get("POLARS_MAX_THREADS")
    os.environ["POLARS_MAX_THREADS"] = "1"  # workers already fill the cores
    try:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(point, *a): i for i, a in enumerate(args)}
            for done, fut in enumerate(as_completed(futures), 1):
                i = futures[fut]
                try:
                    results[i] = fut.result()
                except Exception as err:  # noqa: BLE001 - a worker died: that point failed
                    results[i] = {"status": STATUS_FAILED, "error": one_line(err)}
                if progress:
                    progress(done, total)
    finally:
        if saved is None:
            os.environ.pop("POLARS_MAX_THREADS", None)
        else:
            os.environ["POLARS_MAX_THREADS"] = saved
    return results


def run_grid(grid: Grid, workers: int | None = None,
             progress: Callable[[int, int], None] | None = None, backend: str = "local",
             address: str | None = None) -> list[dict[str, Any]]:
    """Run every point; rows in point order: `point`, axis values, (seed), status, error,
    metrics (run_calls: local worker processes or Ray)."""
    points = grid.points()
    args = [(grid.scenario, point_sets(grid, p), grid.trace) for p in points]
    results = run_calls(run_point, args, workers, progress, backend, address)
    rows = []
    for i, (point, res) in enumerate(zip(points, results, strict=True)):
        axis_values = {k: resolved(k, v) for k, v in point.items() if k != "seed"}
        if "seed" in point:
            axis_values["seed"] = point["seed"]
        rows.append({"point": i, **axis_values, **(res or {})})
    return rows


def results_frame(grid: Grid, rows: list[dict[str, Any]]):
    """One row per point: point, axis values, seed, status, error, SUMMARY_KEYS, EXTRA_KEYS,
    warnings. An axis whose values mix types is stored as text."""
    import polars as pl

    axes = list(grid.axes) + (["seed"] if grid.seeds is not None else [])
    columns: dict[str, list[Any]] = {"point": [r["point"] for r in rows]}
    for key in axes:
        values = [r[key] for r in rows]
        kinds = {type(v) for v in values}
        if kinds == {int, float}:
            values = [float(v) for v in values]
        elif len(kinds) > 1:
            values = [set_text(v) for v in values]
        columns[key] = values
    columns["status"] = [r["status"] for r in rows]
    columns["error"] = [r.get("error") for r in rows]
    for key in (*SUMMARY_KEYS, *EXTRA_KEYS):
        columns[key] = [None if r.get(key) is None else float(r[key]) for r in rows]
    columns["warnings"] = [r.get("warnings") for r in rows]
    schema = {k: pl.Float64 for k in (*SUMMARY_KEYS, *EXTRA_KEYS)}
    schema.update(point=pl.Int64, status=pl.Utf8, error=pl.Utf8, warnings=pl.Utf8)
    return pl.DataFrame(columns, schema_overrides=schema)
