"""`ssdmoe trace {summary, compare, export}`: read a trace directory (no MLX)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from contract.errors import BadInput

app = typer.Typer(no_args_is_help=True, help="Read, compare and export recorded traces.")

DirArg = Annotated[
    Path, typer.Argument(metavar="DIR", help="Trace directory (run.json + *.parquet).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the metrics as JSON.")]


def format_metric(key: str, value: Any) -> str:
    """A metric value for a table cell: bytes as MiB/GiB, fractions to 3 places, None as '-'."""
    if value is None:
        return "-"
    if key.endswith("_bytes"):
        if value >= 1 << 30:
            return f"{value / (1 << 30):.2f} GiB"
        return f"{value / (1 << 20):.1f} MiB" if value >= 1 << 20 else f"{value} B"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.3f}"


def metrics_table(title: str, columns: dict[str, dict[str, Any]],
                  ratio: tuple[str, str] | None = None) -> Table:
    """One row per summary metric, one column per named metrics dict; with ratio=(a, b) a
    last column b/a. Shared with `sim` commands so measured and simulated print alike."""
    from traces.summary import METRIC_INFO

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("unit", style="dim")
    for name in columns:
        table.add_column(name, justify="right")
    if ratio:
        table.add_column(f"{ratio[1]}/{ratio[0]}", justify="right")
    for key, (label, unit) in METRIC_INFO.items():
        cells = [format_metric(key, col.get(key)) for col in columns.values()]
        if ratio:
            r = _ratio(columns[ratio[0]].get(key), columns[ratio[1]].get(key))
            cells.append("-" if r is None else f"{r:.3f}")
        table.add_row(label, "" if unit == "bytes" else unit, *cells)
    return table


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def _load(directory: Path):
    from traces.reader import read_trace

    return read_trace(directory)


def _incomplete_note(trace: Any, console: Console) -> None:
    if not trace.complete:
        console.print(f"[yellow]incomplete trace[/yellow]: {trace.path} (run.json complete=false;"
                      " the run was cut short, showing what was flushed)")


@app.command()
def summary(directory: DirArg, as_json: JsonOpt = False) -> None:
    """Decode/prefill tok/s, step-time percentiles, loads, bytes, overlap, entropy, memory."""
    from traces.regime import regime
    from traces.summary import summarize, summarize_layers

    trace = _load(directory)
    metrics = summarize(trace)
    warning = regime(trace, metrics["adjacent_overlap"]).warning()
    if as_json:
        if not trace.complete:
            print(f"warning: incomplete trace {trace.path}", file=sys.stderr)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        print(json.dumps(metrics, indent=2))
        return
    console = Console()
    _incomplete_note(trace, console)
    if warning:
        console.print(f"[yellow]warning[/yellow]: {warning}")
    n = trace.steps.height
    policy = (trace.run.get("engine") or {}).get("cache_policy")
    policy = f", cache policy {policy}" if policy else ""
    console.print(metrics_table(f"{trace.path} ({trace.kind}, {n} steps{policy})",
                                {trace.kind: metrics}))
    layers = summarize_layers(trace)
    if layers.height:
        table = Table(title="per layer (decode)")
        for col in ("layer", "tokens", "overlap", "entropy", "loads/step", "cold", "wait ms/step"):
            table.add_column(col, justify="right")
        for r in layers.iter_rows(named=True):
            table.add_row(
                str(r["layer"]), str(r["tokens"]),
                format_metric("", r["adjacent_overlap"]), format_metric("", r["load_entropy"]),
                format_metric("", r["loads_per_step"]), format_metric("", r["cold_fraction"]),
                format_metric("", r["wait_ms_per_step"]),
            )
        console.print(table)


@app.command()
def compare(a: DirArg, b: DirArg, as_json: JsonOpt = False) -> None:
    """Two traces side by side with the ratio B/A."""
    from traces.summary import summarize

    ta, tb = _load(a), _load(b)
    ma, mb = summarize(ta), summarize(tb)
    if as_json:
        for t in (ta, tb):
            if not t.complete:
                print(f"warning: incomplete trace {t.path}", file=sys.stderr)
        ratio = {k: _ratio(ma[k], mb[k]) for k in ma}
        print(json.dumps({"a": ma, "b": mb, "ratio_b_over_a": ratio}, indent=2))
        return
    console = Console()
    for t in (ta, tb):
        _incomplete_note(t, console)
    console.print(f"A = {ta.path} ({ta.kind})\nB = {tb.path} ({tb.kind})")
    console.print(metrics_table("trace compare", {"A": ma, "B": mb}, ratio=("A", "B")))


@app.command()
def export(
    directory: DirArg,
    chrome: Annotated[Path, typer.Option("--chrome", help="Output Chrome trace JSON file.")],
) -> None:
    """Write a Chrome trace event file (open in ui.perfetto.dev or chrome://tracing)."""
    from traces.chrome import write_chrome

    trace = _load(directory)
    if not chrome.parent.is_dir():
        raise BadInput(f"{chrome}: output folder {chrome.parent} does not exist")
    try:
        n = write_chrome(trace, chrome)
    except OSError as err:
        raise BadInput(f"{chrome}: cannot write ({err.strerror or err})") from None
    note = " (incomplete trace)" if not trace.complete else ""
    print(f"wrote {n} events to {chrome}{note}")
