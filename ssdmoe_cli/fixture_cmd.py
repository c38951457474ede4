"""`ssdmoe fixture NAME --out DIR`: build an offline, deterministic fixture model directory that
`mlx_lm.load(DIR)` loads unchanged. `ssdmoe fixture --list` names the fixtures.

The build goes to a sibling temporary directory and is renamed into place at the end, so an
interrupted build never leaves a half-written model at DIR."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput
from ssdmoe_cli.atomic_dir import build_into

TRAINED = "tiny-trained"


def register(app: typer.Typer) -> None:
    app.command("fixture")(fixture)


def fixture(
    name: Annotated[str | None, typer.Argument(help="Fixture name (see --list).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Output model directory.")] = None,
    seed: Annotated[int, typer.Option(help="Same seed (and steps) gives identical weights.")] = 0,
    steps: Annotated[int | None, typer.Option(
        help=f"Training steps ({TRAINED} only; default 120).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing model dir.")] = False,
    list_: Annotated[bool, typer.Option("--list", help="List fixture names and exit.")] = False,
) -> None:
    """Build a small offline MoE fixture model (mlx-lm model directory)."""
    from engine.fixtures import FIXTURES, builder

    if list_:
        for fixture_name, (_, _, description) in FIXTURES.items():
            typer.echo(f"{fixture_name:14s} {description}")
        return
    valid = ", ".join(FIXTURES)
    if name is None:
        raise BadInput(f"fixture: missing NAME (one of: {valid})")
    if name not in FIXTURES:
        raise BadInput(f"fixture: unknown fixture {name!r} (valid: {valid})")
    if out is None:
        raise BadInput("fixture: --out DIR is required")
    if steps is not None and name != TRAINED:
        raise BadInput(f"fixture: --steps applies only to {TRAINED}")
    if steps is not None and steps < 1:
        raise BadInput(f"fixture: --steps must be >= 1, got {steps}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise BadInput(f"{out}: directory is not empty (use --force to replace it)")
        if not (out / "config.json").exists() and not (out / "fixture.json").exists():
            raise BadInput(f"{out}: not a model directory (no config.json); refusing to replace")

    if name == TRAINED:
        # Training needs OpenBLAS for float32 matmuls (~35x the bundled BLAS); re-runs this
        # command with it preloaded when available. Returns here if already active or absent.
        from engine.blas import reexec_with_fast_blas

        reexec_with_fast_blas()

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        builder(name)(tmp, seed, **({"steps": steps} if steps is not None else {}))

    t0 = time.perf_counter()
    build_into(out, out.parent / f".{out.name}.building", build)
    typer.echo(f"{name}: wrote {out} in {time.perf_counter() - t0:.1f} s")
