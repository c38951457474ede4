"""`ssdmoe loadtest MODEL`: many clients against a real `ssdmoe serve` (server.load_test);
prints a table and writes JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput


def register(app: typer.Typer) -> None:
    app.command("loadtest")(loadtest)


def loadtest(
    model: Annotated[Path, typer.Argument(help="Converted model directory to serve.")],
    clients: Annotated[int, typer.Option("--clients", help="Concurrent clients.")] = 8,
    requests: Annotated[int, typer.Option("--requests", help="Requests per client.")] = 5,
    leavers: Annotated[int, typer.Option(
        "--leavers", help="Clients that disconnect after their first streamed chunk.")] = 2,
    repeats: Annotated[int, typer.Option(
        "--repeats", help="Repetitions (RSS must be stable across them).")] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per request.")] = 24,
    preset: Annotated[str, typer.Option("--preset", help="Engine preset served.")] = "staged",
    out: Annotated[Path, typer.Option("--out", help="JSON written here.")]
        = Path("reports/serve/load.json"),
) -> None:
    """Load-test `ssdmoe serve`: outputs equal the sequential ones, FIFO order, the queue back
    to 0, stable RSS, and p50/p99 latency. Exits 1 when a check fails."""
    if min(clients, requests, repeats, max_tokens) < 1 or leavers < 0:
        raise BadInput("--clients, --requests, --repeats and --max-tokens must be >= 1, "
                       "--leavers >= 0")
    if not (model / "manifest.json").is_file():
        raise BadInput(f"{model / 'manifest.json'}: missing (not a converted model)")
    from server.load_test import LoadSpec, run_load, table, write

    spec = LoadSpec(model=model, clients=clients, requests=requests, leavers=leavers,
                    repeats=repeats, max_tokens=max_tokens, preset=preset)
    try:
        result = run_load(spec, say=lambda s: typer.echo(s, err=True))
    except RuntimeError as err:
        raise BadInput(f"loadtest: {err}") from None
    write(result, out)
    typer.echo(table(result))
    typer.echo(f"wrote {out}")
    if not result["passed"]:
        raise typer.Exit(1)
