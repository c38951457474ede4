"""`ssdmoe sim run | sweep | compare | profile-model`: simulate scenarios, grids of them, and
measured traces next to their simulation (no MLX)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from contract.errors import BadInput

app = typer.Typer(no_args_is_help=True, help="Simulate other hardware, caches and policies.")

MAIN_EXTRA = ("page_cache_bytes", "page_cache_capacity_bytes", "sim_steps_per_s")


def flat_json(result: Any) -> dict[str, Any]:
    """SUMMARY_KEYS first (same names and units as `trace summary --json`), then sim figures."""
    sc_run = result.trace.run
    out: dict[str, Any] = dict(result.metrics)
    out["page_cache_bytes"] = result.figures.page_cache_capacity_bytes
    out["peak_engine_bytes"] = result.figures.memory["engine"]
    out["sim_steps_per_s"] = result.figures.sim_steps_per_s
    out["scenario"] = sc_run["extra"]["scenario"]
    out["sim"] = result.figures.as_dict(memory=False)
    out["memory"] = result.figures.memory
    return out


@app.command()
def run(
    scenario: Annotated[str, typer.Argument(help="Scenario name (scenarios/NAME.toml) or path.")],
    trace: Annotated[Path | None, typer.Option("--trace", help="Replay this trace's routing "
                                               "(default: synthetic routing).")] = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a scenario/hardware/model key: key=value (repeatable), e.g. "
        "k=8, path=staged, lead=token, ram_gib=24, ssd_bandwidth_gbps=3, lru_bytes=1GiB.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
    chrome: Annotated[Path | None, typer.Option("--chrome", help="Also write a Chrome trace "
                                                "of the simulated run.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the simulated trace "
                                             "directory here.")] = None,
) -> None:
    """Simulate SCENARIO; prints the same metrics as `trace summary` plus simulator figures."""
    from sim.profiles import load_scenario
    from sim.replay import run_scenario

    sc = load_scenario(scenario, sets or [])
    measured = None
    if trace is not None:
        from traces.reader import read_trace

        measured = read_trace(trace)
    if chrome is not None and not chrome.parent.is_dir():
        raise BadInput(f"{chrome}: output folder {chrome.parent} does not exist")
    result = run_scenario(sc, trace=measured, out=out)
    if chrome is not None:
        from traces.chrome import write_chrome

        write_chrome(result.trace, chrome)
    if as_json:
        for warning in result.figures.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(json.dumps(flat_json(result), indent=2, default=str))
        return
    _print(sc, result, chrome, out)


def _print(sc: Any, result: Any, chrome: Path | None, out: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from ssdmoe_cli.trace_cmds import format_metric, metrics_table

    console = Console()
    title = (f"{sc.name}: {sc.model.name} K={sc.k} on {sc.hardware.name}, {sc.arm()}")
    console.print(metrics_table(title, {"simulated": result.metrics}))
    e, mem = result.figures, result.figures.memory
    table = Table(title="simulator")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("page cache (capacity)", format_metric("x_bytes", e.page_cache_capacity_bytes)),
        ("engine memory (MLX model)", format_metric("x_bytes", mem["engine"])),
        ("OS reserve", format_metric("x_bytes", mem["os_reserve"])),
        ("OS held (after giving way)", format_metric("x_bytes", mem["os_held"])),
        ("page-cache hit rate", format_metric("", e.page_cache_hit_rate)),
        ("bundle LRU hit rate", format_metric("", e.lru_hit_rate)),
        ("device busy", format_metric("", e.device_busy_fraction)),
        ("build ms/step", format_metric("", e.build_ms_per_step)),
        ("eval ms/step", format_metric("", e.eval_ms_per_step)),
        ("simulated steps/s", f"{e.sim_steps_per_s:.0f}"),
        ("simulation wall s", f"{e.sim_wall_s:.2f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for warning in e.warnings:
        console.print(f"[yellow]warning[/yellow]: {warning}")
    if out is not None:
        console.print(f"simulated trace written to {out}")
    if chrome is not None:
        console.print(f"chrome trace written to {chrome}")


@app.command()
def sweep(
    grid: Annotated[Path, typer.Argument(help="Grid file (scenarios/grids/NAME.toml).")],
    workers: Annotated[int | None, typer.Option(
        "--workers", help="Worker processes (default: one per core).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Output folder (default reports/sweeps/<grid name>).")] = None,
    backend: Annotated[str, typer.Option(
        "--backend", help="local (worker processes) or ray (Ray tasks: the optional extra; "
        "a local cluster unless RAY_ADDRESS or --address names one).")] = "local",
    address: Annotated[str | None, typer.Option(
        "--address", help="Ray cluster to join (--backend ray).")] = None,
) -> None:
    """Run every point of GRID in worker processes (or on Ray); write Parquet, PNGs and a
    README.

    A failing point is reported as failed with its reason; the others still run."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from sim.sweep import BACKENDS, check_grid, load_grid, results_frame, run_grid
    from sim.sweep_outputs import write_outputs

    if workers is not None and workers < 1:
        raise BadInput(f"--workers: must be >= 1, got {workers}")
    if backend not in BACKENDS:
        raise BadInput(f"--backend {backend}: unknown backend (one of {', '.join(BACKENDS)})")
    if backend == "ray":
        from sim.sweep_ray import ray_module

        ray_module()  # not installed: one line, before any point runs
    g = load_grid(grid)
    check_grid(g)
    out = out if out is not None else Path("reports") / "sweeps" / g.name
    total = len(g.points())
    console = Console(stderr=True)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task(f"sweep {g.name}", total=total)
        rows = run_grid(g, workers, lambda done, _: bar.update(task, completed=done),
                        backend=backend, address=address)
    frame = results_frame(g, rows)
    command = "ssdmoe sim sweep " + str(grid) + (f" --workers {workers}" if workers else "") + \
        (f" --backend {backend}" if backend != "local" else "") + \
        (f" --out {out}" if out != Path("reports") / "sweeps" / g.name else "")
    written = write_outputs(g, frame, out, command)
    failed = frame.filter(frame["status"] != "ok")
    console = Console(soft_wrap=True)
    console.print(f"{g.name}: {frame.height} points, {frame.height - failed.height} ok, "
                  f"{failed.height} failed; wrote {', '.join(str(p) for p in written)}")
    for r in failed.iter_rows(named=True):
        axes = ", ".join(f"{k}={r[k]}" for k in [*g.axes, *(["seed"] if g.seeds else [])])
        console.print(f"[yellow]failed[/yellow] point {r['point']} ({axes}): {r['error']}")


@app.command()
def compare(
    trace: Annotated[Path, typer.Argument(metavar="TRACE", help="Measured trace directory.")],
    scenario: Annotated[str | None, typer.Option(
        "--scenario", help="Scenario to replay on (default this-machine-<model> if it exists, "
        "else this machine's hardware + the trace's model profile).")] = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", help="Extra override key=value after the trace's engine config "
        "(repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Also write the simulated trace directory here.")] = None,
) -> None:
    """Replay a measured TRACE on this machine's profile; simulated next to measured.

    The trace's engine configuration (run.json) sets the policy, caches, readers, K, page-cache
    budget and O_DIRECT; its routing is replayed. Every `trace summary` metric is printed with
    the ratio simulated/measured."""
    from sim.compare import compare as run_compare
    from traces.reader import read_trace

    result = run_compare(read_trace(trace), scenario, sets or [], out=out)
    if as_json:
        for note in result.notes:
            print(f"note: {note}", file=sys.stderr)
        print(json.dumps(result.to_dict(), indent=2, default=str))
        return
    from rich.console import Console

    from ssdmoe_cli.trace_cmds import metrics_table
    from traces.summary import cpu_by_thread

    sc = result.scenario
    console = Console(soft_wrap=True)
    title = (f"{trace}: measured vs simulated ({sc.model.name} K={sc.k} on {sc.hardware.name}, "
             f"{sc.arm()})")
    console.print(metrics_table(title, {"measured": result.measured,
                                        "simulated": result.simulated},
                                ratio=("measured", "simulated")))
    console.print("engine config -> scenario: " + ", ".join(result.settings))
    e = result.extra  # a Comparison's (JSON) figures
    console.print(f"build ms/step measured {_fmt(e['measured_build_ms_per_step'])} simulated "
                  f"{_fmt(e['build_ms_per_step'])}; eval ms/step measured "
                  f"{_fmt(e['measured_eval_ms_per_step'])} simulated "
                  f"{_fmt(e['eval_ms_per_step'])}"
                  " (the trace's build/eval split depends on the path: see sim/compare.py)")
    by_thread = e.get("decode_cpu_ms_by_thread") or {}
    if by_thread:
        measured = cpu_by_thread(result.measured)
        console.print("CPU ms/step by thread, simulated: " + ", ".join(
            f"{k} {v:.2f}" for k, v in by_thread.items()) + "; measured: " + ", ".join(
            f"{k} {_fmt(v)}" for k, v in measured.items()))
    by_part = e.get("decode_main_cpu_ms_by_part") or {}
    if by_part:
        console.print("main thread CPU ms/step by part, simulated: " + ", ".join(
            f"{k} {v:.2f}" for k, v in by_part.items())
            + " (measured by part: reports/cross-machine/main_thread_cpu.py)")
    for note in result.notes:
        console.print(f"[yellow]note[/yellow]: {note}")


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


@app.command("profile-model")
def profile_model(
    source: Annotated[Path, typer.Argument(
        metavar="MODEL_DIR|TRACE", help="Converted model directory (manifest.json), or a trace "
        "directory (its run.json names the model; its routing is fitted).")],
    out: Annotated[Path, typer.Option("--out", help="scenarios/models/NAME.toml to write.")],
    build_ms: Annotated[float | None, typer.Option(
        "--build-ms", help="Graph building per layer, ms (measured by ssdmoe calibrate; "
        "default: machine-notes' tiny-model figure).")] = None,
    graph_of: Annotated[str | None, typer.Option(
        "--graph-of", help="The model profile (a name beside --out) whose decoder graph this "
        "model shares, its experts of another width: graph building, dispatch and primitives "
        "are then that profile's (its calibration's), not written here.")] = None,
    traces: Annotated[list[Path] | None, typer.Option(
        "--trace", help="Also fit routing statistics to this trace (repeatable: traces routed "
        "at several K fit how reuse and skew scale with K; a trace run with --prerouter fits "
        "the prerouted_ keys: the heads' routing).")] = None,
) -> None:
    """Write a simulator model profile derived from a converted model's manifest, and routing
    statistics fitted to traces (sim.routing_fit; scenarios use them with
    routing_stats = "model").

    So its traces can be replayed (`sim run --trace`, `sim compare`) and synthetic routing
    looks like the model's own."""
    from sim.model_profile import model_toml, profile_from_manifest, write_model
    from sim.routing_fit import fit_trace, profile_values
    from traces.reader import read_trace

    if out.suffix != ".toml":
        raise BadInput(f"--out {out}: expected a .toml path (scenarios/models/NAME.toml)")
    if build_ms is not None and build_ms < 0:
        raise BadInput(f"--build-ms: must be >= 0, got {build_ms}")
    if graph_of is not None and not (out.parent / f"{graph_of}.toml").is_file():
        raise BadInput(f"--graph-of {graph_of}: no model profile {out.parent / graph_of}.toml "
                       "(the model whose graph this one shares, beside --out)")
    fitted = [read_trace(t) for t in traces or []]
    model_dir = source
    if (source / "run.json").is_file():  # a trace: fit it, and find its model
        trace = read_trace(source)
        fitted.insert(0, trace)
        path = (trace.run.get("model") or {}).get("path")
        if not path or not (Path(path) / "manifest.json").is_file():
            raise BadInput(f"{source}/run.json: model.path {path!r} has no manifest.json (give "
                           "the converted model directory, and the trace with --trace)")
        model_dir = Path(path)
        if model_dir.is_absolute() and model_dir.is_relative_to(Path.cwd()):
            model_dir = model_dir.relative_to(Path.cwd())  # the profile names it portably
    how = None if build_ms is None else "given with --build-ms"
    values = profile_from_manifest(model_dir, build_ms, how)
    if graph_of is not None:
        if build_ms is None:  # the graph's own figure comes from graph_of's profile
            del values["build_ms_per_layer"]
        values["graph_of"] = (graph_of, f"the same decoder graph as {graph_of} (given with "
                              "--graph-of): its graph figures are that profile's")
    fits = [fit_trace(t) for t in fitted]
    for f in fits:
        if (f.layers, f.experts) != (values["layers"][0], values["experts"][0]):
            raise BadInput(f"{f.source}: routing of {f.layers} layers x {f.experts} experts, "
                           f"but {model_dir} has {values['layers'][0]} x {values['experts'][0]}")
        print(f"{f.source}: K={f.k}, {f.tokens} token pairs: reuse {f.reuse:.3f}, load entropy "
              f"{f.load_entropy:.3f}, recall {f.recall} over {f.window} tokens -> skew "
              f"{f.skew:.3f}")
    # traces run with prerouter heads route by the heads' predictions: fitted apart
    prerouted = [bool((t.run.get("engine") or {}).get("prerouter")) for t in fitted]
    for prefix, mine in (("", [f for f, p in zip(fits, prerouted, strict=True) if not p]),
                         ("prerouted_", [f for f, p in zip(fits, prerouted, strict=True) if p])):
        if mine:
            values.update(profile_values(mine, prefix))
    cmd = " ".join(["ssdmoe sim profile-model", str(source), "--out", str(out),
                    *([f"--graph-of {graph_of}"] if graph_of else []),
                    *(f"--trace {t}" for t in traces or [])])
    header = [f"{out.stem}: derived from {model_dir}/manifest.json by `{cmd}`."]
    write_model(out, model_toml(values, out.stem, header))
    print(f"wrote {out}")


@app.command("keys")
def keys(
    write: Annotated[Path | None, typer.Option(
        "--write", help="Write the reference to this file (docs/simulator.md) instead of "
        "printing it.")] = None,
) -> None:
    """Every hardware, model and scenario key: unit, meaning, default, how to obtain it."""
    from sim.key_reference import markdown

    text = markdown()
    if write is None:
        typer.echo(text, nl=False)
        return
    try:
        write.parent.mkdir(parents=True, exist_ok=True)
        write.write_text(text)
    except OSError as err:
        raise BadInput(f"{write}: cannot write ({err.strerror})") from None
    typer.echo(f"wrote {write}")
