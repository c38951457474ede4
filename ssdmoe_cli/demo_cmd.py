"""`ssdmoe demo`: the main job on the built-in default. Builds the tiny-trained fixture
(offline, once), converts it to the streaming layout (once), generates text while streaming
experts from disk and recording a trace, then prints the trace summary. Each stage is the
ordinary CLI command, so the demo shows exactly what a user would type."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from ssdmoe_cli import model_cmds, trace_cmds

DEFAULT_PROMPT = "The with statement is used to wrap the execution of a block"
DEMO_MBPS = 15.0  # below on-demand's cold-read demand at a 1/4 page cache (~40 MB/s here)
DEMO_HEAD_STEPS = 200  # quick heads for the demo (the full training: 600 steps on 256
DEMO_HEAD_WINDOWS = 64  # windows, ~6 min here)
# The first demo on this project's 2-core x86 VM, otherwise idle (README): the fixture build
# (120 training steps, the corpus, tokenizer and routing report), then the rest: convert,
# generate, quick heads, two captures and their simulations
IDLE_BUILD_MIN_2_CORES = 10.7
REST_OF_DEMO_MIN = 1.0
# one core runs the build's two streams in turn: the one-stream pace
# (reports/fixtures/two_streams.json)
ONE_CORE_SLOWER = 1.5


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def _stale(converted: Path, source: Path) -> bool:
    manifest = converted / "manifest.json"
    weights = source / "model.safetensors"
    return not manifest.is_file() or manifest.stat().st_mtime < weights.stat().st_mtime


def demo(
    models: Annotated[Path, typer.Option("--models", help="Where fixture models live.")] = Path(
        "models"),
    preset: Annotated[str, typer.Option("--preset", help="on-demand, hot or staged.")] = "staged",
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt text.")] = DEFAULT_PROMPT,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 96,
    temp: Annotated[float, typer.Option(
        "--temp", help="Sampling temperature (greedy decoding of this small model loops).")] = 0.8,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="Trace directory (default runs/demo-<time>).")] = None,
    validate: Annotated[bool, typer.Option(
        "--validate/--no-validate", help="End with the validation in short (on-demand vs "
        "prerouter, measured and simulated).")] = True,
) -> None:
    """Build tiny-trained (once), convert it (once), generate from SSD with a trace, summarise."""
    source = models / "tiny-trained"
    converted = models / "tiny-trained-stream"
    if not (source / "fixture.json").is_file():
        typer.echo(f"[1/5] building the tiny-trained fixture into {source}, offline: "
                   f"{first_run_estimate()}")
        # In a child process: training re-executes itself with OpenBLAS preloaded, and its
        # memory must not count in the generation's peak RSS below.
        force = ["--force"] if source.exists() else []
        build = [sys.executable, "-m", "ssdmoe_cli", "fixture", "tiny-trained", "--out",
                 str(source), *force]
        code = subprocess.run(build).returncode
        if code != 0:
            raise typer.Exit(code)
    else:
        typer.echo(f"[1/5] fixture {source} exists")
    if _stale(converted, source):
        typer.echo(f"[2/5] converting to the streaming layout in {converted}")
        model_cmds.convert(source, converted, bits=4, group_size=64, force=converted.exists())
    else:
        typer.echo(f"[2/5] streaming layout {converted} is up to date")
    trace = trace or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    typer.echo(f"[3/5] generating with preset {preset!r}, trace in {trace}\n")
    model_cmds.generate(converted, prompt=prompt, max_tokens=max_tokens, temp=temp, seed=0,
                        json_out=False, o_direct=False, page_cache_mb=None, verify=None,
                        preset=preset, trace=trace, force=False)
    typer.echo(f"\n[4/5] trace summary (also: ssdmoe trace summary {trace};"
               f" ssdmoe trace export {trace} --chrome timeline.json)")
    trace_cmds.summary(trace, as_json=False)
    if validate:
        _validate_short(converted, trace.with_name(trace.name + "-validate"))


def first_run_estimate() -> str:
    """How long the first demo takes here, from the idle 2-core figure scaled by this
    machine's cores and its load now (a busy machine shares its cores with the build)."""
    import os

    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    slower = (ONE_CORE_SLOWER if cores < 2 else 1.0) \
        * (1 + max(load - 1.0, 0.0) / cores)  # a load up to 1: idle
    minutes = IDLE_BUILD_MIN_2_CORES * slower + REST_OF_DEMO_MIN
    return (f"the first demo takes about {minutes:.0f} minutes on this machine ({cores} cores, "
            f"load {load:.1f}; {IDLE_BUILD_MIN_2_CORES + REST_OF_DEMO_MIN:.0f} on an idle "
            "2-core machine), most of it training; a progress bar with the time left follows")


def _validate_short(model: Path, out: Path) -> None:
    """The validation in short: on-demand and the prerouter (token lead) under a page-cache
    budget of 1/4 of the expert bytes and, where it can be set, a read throttle below
    on-demand's demand; each captured, then simulated; measured and simulated side by side."""
    from rich.console import Console
    from rich.table import Table

    from engine.throttle import ThrottleSpec, ThrottleUnavailable, check_available
    from validation import matrix_run as run
    from validation.matrix import Config

    storage = f"{DEMO_MBPS:g}mbps"
    try:
        check_available(ThrottleSpec(read_mbps=DEMO_MBPS))
    except ThrottleUnavailable as err:
        typer.echo(f"demo: {err}; measuring unthrottled")
        storage = "unthrottled"
    from engine import platform

    page_cache = "1/4"
    if not platform.current().can_drop_pages:
        typer.echo(f"demo: {platform.current().name} cannot hold the page cache to a budget; "
                   "measuring with every expert cached")
        page_cache = "all"
    heads = model / "prerouter"  # the full heads (`ssdmoe train heads`), when trained
    if not (heads / "prerouter.json").is_file():
        heads = model / "prerouter-quick"
    if not (heads / "prerouter.json").is_file():
        typer.echo(f"[5/5] training quick prerouter heads into {heads} ({DEMO_HEAD_STEPS} "
                   f"steps on {DEMO_HEAD_WINDOWS} windows; `ssdmoe train heads {model}` trains "
                   "the full ones in ~6 min)")
        code = subprocess.run(run.cli("train", "heads", str(model), "--out", str(heads),
                                      "--steps", str(DEMO_HEAD_STEPS), "--train-windows",
                                      str(DEMO_HEAD_WINDOWS), "--eval-windows", "16")).returncode
        if code != 0:
            raise typer.Exit(code)
    reads = "unthrottled" if storage == "unthrottled" else f"throttled to {DEMO_MBPS:g} MB/s"
    budget = "1/4 of the experts" if page_cache == "1/4" else "unbudgeted"
    typer.echo(f"[5/5] validation in short: page cache {budget}, reads {reads}, "
               f"sampled decoding; each arm captured, then simulated (into {out})")
    plan = run.Plan(model=model, out=out, prompts=2, max_tokens=48, heads=heads)
    prompts = run.prompts_file(plan)
    rows = []
    for path in ("on-demand", "staged-token"):
        c = Config(path=path, storage=storage, page_cache=page_cache)
        run.capture(plan, c, prompts)
        rows.append(run.compare_one(plan, c))
    table = Table(title="measured / simulated (sim compare on this machine's profile)")
    for col in ("arm", "decode tok/s", "blocked ms/step", "cold fraction", "MiB/step"):
        table.add_column(col, justify="right")
    for r in rows:
        m, s = r["measured"], r["simulated"]
        table.add_row(r["config"]["path"], *(
            f"{m[k]:.2f} / {s[k]:.2f}" if m.get(k) is not None and s.get(k) is not None
            else "-" for k in ("decode_tok_s", "blocked_ms_per_step", "cold_fraction",
                               "mib_per_step")))
    Console().print(table)
    gain = rows[1]["measured"]["decode_tok_s"] / rows[0]["measured"]["decode_tok_s"]
    sim_gain = rows[1]["simulated"]["decode_tok_s"] / rows[0]["simulated"]["decode_tok_s"]
    typer.echo(f"prerouter over on-demand: measured {gain:.2f}x, simulated {sim_gain:.2f}x. "
               "The whole matrix, with errors per component: `ssdmoe validate --quick` "
               "(reports/validation/README.md).")
