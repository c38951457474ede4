"""`ssdmoe calibrate --out scenarios/hardware/NAME.toml`: measure this machine's storage and the
real engine's compute and graph building, and write a hardware profile (and optionally the
measured model's profile and a scenario combining them). MLX is imported inside the command."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from contract.errors import BadInput


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)


def calibrate(
    out: Annotated[Path | None, typer.Option(
        "--out", help="Hardware profile to write (scenarios/hardware/NAME.toml).")] = None,
    model: Annotated[Path | None, typer.Option(
        "--model", help="Converted model to time (default models/tiny-trained-stream, else "
        "tiny-random built in a temp dir).")] = None,
    scratch: Annotated[Path | None, typer.Option(
        "--dir", help="Folder for the storage scratch file (default: next to the model).")] = None,
    model_out: Annotated[Path | None, typer.Option(
        "--model-out", help="Also write the measured model's profile "
        "(scenarios/models/NAME.toml).")] = None,
    scenario_out: Annotated[Path | None, typer.Option(
        "--scenario-out", help="Also write a scenario combining both profiles with the "
        "engine's per-path main-thread costs (needs --model-out).")] = None,
    json_out: Annotated[Path | None, typer.Option(
        "--json", help="Raw measurements (default reports/calibration/<NAME>.json).")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Few repetitions (seconds, for tests; noisy).")] = False,
    queue_depth_only: Annotated[bool, typer.Option(
        "--queue-depth-only", help="Only measure the device's throughput against reads in "
        "flight with --model's bundle size, and write MODEL/queue_depth.json (the engine's "
        "default --readers); seconds.")] = False,
) -> None:
    """Measure storage (cold/warm reads by size, queue depth, O_DIRECT bandwidth) on a scratch
    file and the engine's kernel, graph-building and non-MoE compute times; write the profile
    with every value commented with how and when it was measured."""
    if queue_depth_only:
        if model is None:
            raise BadInput("--queue-depth-only: needs --model DIR (its bundle size is the read "
                           "size, and its queue_depth.json is written)")
        if not (model / "manifest.json").is_file():
            raise BadInput(f"{model}: not a converted model (no manifest.json; ssdmoe convert)")
        from calibration.queue_depth_probe import measure, summary

        typer.echo(summary(measure(model, scratch)))
        return
    if out is None:
        raise BadInput("calibrate: --out PATH.toml is required (the hardware profile to write)")
    if out.suffix != ".toml":
        raise BadInput(f"--out {out}: expected a .toml path (scenarios/hardware/NAME.toml)")
    if scenario_out is not None and model_out is None:
        raise BadInput("--scenario-out: needs --model-out (the scenario names both profiles)")
    if model is not None and not (model / "manifest.json").is_file():
        raise BadInput(f"{model}: not a converted model (no manifest.json; ssdmoe convert)")
    if scratch is not None and not scratch.is_dir():
        raise BadInput(f"--dir {scratch}: not a directory")

    from calibration.calibrate import calibrate as run
    from calibration.profile_values import as_dict, hardware_toml, write_hardware
    from sim.model_profile import model_toml, write_model

    cal = run(model, scratch, quick=quick)
    name = out.stem
    command = " ".join(["ssdmoe calibrate", *sys.argv[2:]]) if len(sys.argv) > 1 and \
        sys.argv[1] == "calibrate" else f"ssdmoe calibrate --out {out}"
    json_path = json_out or Path("reports") / "calibration" / f"{name}.json"
    header = [f"Raw measurements: {json_path}. Compute and graph building measured on "
              f"{cal.model_label}; storage on a scratch file in {cal.storage.scratch}.",
              f"Load average at the start: {_loadavg()} (a shared machine: compute figures "
              "move with other processes' load)."]
    from calibration.machine import machine_line

    written = [write_hardware(out, hardware_toml(cal.hardware, name, cal.when, command, header,
                                                 machine_line()))]
    if model_out is not None:
        mname = model_out.stem
        mheader = [f"{mname}: derived from {cal.model_dir}/manifest.json by `{command}` "
                   f"({cal.when}); build_ms_per_layer measured on this machine (cpu_factor 1 "
                   f"in {name}.toml)."]
        values = {**cal.model, **_kept_routing_fit(model_out)}
        written.append(write_model(model_out, model_toml(values, mname, mheader)))
    if scenario_out is not None:
        written.append(_write_scenario(scenario_out, _ref(out, "hardware"),
                                       _ref(model_out, "models"), cal, command))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({
        "when": cal.when, "command": command, "seconds": cal.seconds,
        "model": str(cal.model_dir), "storage": as_dict(cal.storage),
        "compute": as_dict(cal.compute), "engine_steps": cal.engine,
        "hardware": {k: v for k, (v, _) in cal.hardware.items()},
        "model_profile": {k: v for k, (v, _) in cal.model.items()},
    }, indent=1, default=str) + "\n")
    written.append(json_path)
    _print(cal, written)


def _ref(path: Path, sub: str) -> str:
    """How a scenario names a profile: its stem when it lives in scenarios/<sub>/, else the
    path."""
    from sim.profiles import ROOT

    if path.resolve().parent == (ROOT / sub).resolve():
        return path.stem
    return str(path.resolve())


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


PRESET_NOTES = {
    "exact": "on-demand preset: exact path: graph building + its extra work (np.unique, a "
             "fresh stack per layer, evaluated) per decode step, net of reads and syncs",
    "exact_alone": "the same extra work timed alone in a tight loop: less than in decode, where "
                   "each stack's evaluation waits for MLX's compute thread after a router sync "
                   "(reports/cross-machine: in-decode fits 0.42 ms on two machines)",
    "hot": "hot preset: shared LRU pool, misses read by reader threads",
    "staged": "staged preset: sticky slots filled by reader threads",
}


def _write_scenario(path: Path, hardware: str, model: str, cal: Any, command: str) -> Path:
    from sim.in_decode import is_fitted
    from sim.profiles import load_scenario, write_checked

    c = cal.compute
    exact = c.path_build_ms_per_layer.get("exact", c.engine_build_ms_per_layer)
    lines = [
        f"# This machine running {model} through this project's engine, as `ssdmoe sim compare`",
        "# replays its traces. Written by `" + command + f"` ({cal.when}).",
        "# Defaults describe the engine's default preset (on-demand: the exact path, no app",
        "# cache, every routed bundle read on the main thread after the router's host sync);",
        "# `sim compare` maps each trace's engine config onto these keys.",
        f'hardware = "{hardware}"',
        f'model = "{model}"',
        f'description = "{Path(model).stem} on {Path(hardware).stem} through the ssdmoe engine '
        '(on-demand preset)"',
        'path = "exact"                # the on-demand preset\'s decode path: no app cache',
        "readers = 0                   # exact path: reads on the main thread",
        "decode_steps = 200",
        "overlap = 0.24                # synthetic routing only: machine-notes held-out adjacent "
        "overlap of tiny-trained",
        "",
        "[model_overrides]",
        f"build_ms_per_layer = {exact:.4f}   # measured: the exact path's main-thread work per "
        "layer (graph building + np.unique + stack allocation), see [in_decode]",
        "",
        "[notes]  # records, in words",
    ]
    fits = ["", "[in_decode]  # figures `sim compare` applies per engine configuration "
            "(sim.in_decode); `ssdmoe validate` refits them inside decode"]
    for p, v in c.path_build_ms_per_layer.items():
        key = f"build_ms_per_layer.{p}"
        if is_fitted(key):
            fits.append(f'"{key}" = {v:.4f}  # {PRESET_NOTES.get(p, p)}')
        else:
            lines.append(f'"{key}" = "{v:.4f}"  # {PRESET_NOTES.get(p, p)}')
    lines.append(f'"build_ms_per_layer.pure" = "{c.build_ms_per_layer:.4f}"  # graph building '
                 "only (the model profile's value)")
    from calibration.profile_values import direct_cold_overhead

    direct = direct_cold_overhead(cal.storage, c, cal.hardware)
    if direct is not None:
        fits.append(f'"cold_overhead_ms.o_direct" = {direct:.4f}  # O_DIRECT bundle read '
                    f"{c.direct_bundle_ms:.3f} ms through the engine's store, minus device "
                    "time, copy and load overhead (used by `sim compare` for O_DIRECT traces)")
    lines += fits
    return write_checked(path, "\n".join(lines) + "\n", load_scenario)


def _print(cal: Any, written: list[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"calibration ({cal.seconds:.0f} s)")
    table.add_column("key")
    table.add_column("value", justify="right")
    table.add_column("how", overflow="fold")
    for key, (value, how) in cal.hardware.items():
        table.add_row(key, str(value), how[:120])
    table.add_row("build_ms_per_layer (model)", str(cal.model["build_ms_per_layer"][0]),
                  "graph building per layer")
    console = Console(soft_wrap=False)
    console.print(table)
    console.print("wrote " + ", ".join(str(p) for p in written))


def _kept_routing_fit(path: Path) -> dict:
    """The routing statistics an earlier `sim profile-model --trace` fitted into `path`: a
    calibration measures the machine, not the model's routing, so it keeps them."""
    import tomllib

    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}
    how = {}  # each line's own comment: where the fit came from
    for line in path.read_text().splitlines():
        key, _, comment = line.partition("#")
        key = key.split("=")[0].strip()
        if key.startswith(ROUTING_FITS) and comment.strip():
            how[key] = comment.strip().removeprefix(KEPT).strip()
    return {k: (v, f"{KEPT} {how.get(k, '(sim profile-model --trace)')}")
            for k, v in data.items() if k.startswith(ROUTING_FITS)}


KEPT = "kept from the earlier profile:"
# the router's routing and the prerouter heads' (a trace run with --prerouter)
ROUTING_FITS = ("routing_", "prerouted_routing_")
