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
) -> None:
    """Build tiny-trained (once), convert it (once), generate from SSD with a trace, summarise."""
    source = models / "tiny-trained"
    converted = models / "tiny-trained-stream"
    if not (source / "fixture.json").is_file():
        typer.echo(f"[1/4] building the tiny-trained fixture into {source} (offline, minutes)")
        # In a child process: training re-executes itself with OpenBLAS preloaded, and its
        # memory must not count in the generation's peak RSS below.
        force = ["--force"] if source.exists() else []
        build = [sys.executable, "-m", "ssdmoe_cli", "fixture", "tiny-trained", "--out",
                 str(source), *force]
        code = subprocess.run(build).returncode
        if code != 0:
            raise typer.Exit(code)
    else:
        typer.echo(f"[1/4] fixture {source} exists")
    if _stale(converted, source):
        typer.echo(f"[2/4] converting to the streaming layout in {converted}")
        model_cmds.convert(source, converted, bits=4, group_size=64, force=converted.exists())
    else:
        typer.echo(f"[2/4] streaming layout {converted} is up to date")
    trace = trace or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    typer.echo(f"[3/4] generating with preset {preset!r}, trace in {trace}\n")
    model_cmds.generate(converted, prompt=prompt, max_tokens=max_tokens, temp=temp, seed=0,
                        json_out=False, o_direct=False, page_cache_mb=None, verify=None,
                        preset=preset, trace=trace, force=False)
    typer.echo(f"\n[4/4] trace summary (also: ssdmoe trace summary {trace};"
               f" ssdmoe trace export {trace} --chrome timeline.json)")
    trace_cmds.summary(trace, as_json=False)
