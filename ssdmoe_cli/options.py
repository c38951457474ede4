"""Command-line options that several commands share, declared once (typer Annotated types)."""

from __future__ import annotations

from typing import Annotated

import typer

ReadMbps = Annotated[str | None, typer.Option(
    "--read-mbps", help="Throttle reads from the model's disk to N MB/s (the kernel's block-I/O "
    "throttle; Linux, root).")]
ReadIops = Annotated[str | None, typer.Option(
    "--read-iops", help="Throttle reads from the model's disk to N reads per second.")]
Temp = Annotated[float, typer.Option(
    "--temp", help="Sampling temperature (default 1.0: realistic routing; 0 = greedy, whose "
    "tiny-fixture text loops).")]
Seed = Annotated[int, typer.Option("--seed", help="Sampling seed.")]
