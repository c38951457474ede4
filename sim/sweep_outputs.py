"""A sweep's outputs beside its results: results.parquet, a plot per axis (the grid's metric
against one axis, a line per combination of its other text-valued axes, the numeric ones
held) and a README with the command, the grid and the results table."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from sim.sweep import STATUS_OK, Grid, resolved, set_text


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def plot_axis(grid: Grid, frame, axis: str, path: Path) -> None:
    """`grid.metric` against `axis`: one line per combination of the other non-numeric axes
    (path, lead, ...), numeric axes held at `grid.hold` (default: their first value), mean
    over seeds with a min-max band. A combination whose every point failed draws no line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import polars as pl

    def match(k: str, v: Any):
        return pl.col(k) == (set_text(v) if frame[k].dtype == pl.Utf8 else v)

    rest = [k for k in grid.axes if k != axis]
    lines = [k for k in rest if not _numeric([resolved(k, v) for v in grid.axes[k]])]
    held = {k: resolved(k, grid.hold.get(k, grid.axes[k][0])) for k in rest if k not in lines}
    part = frame.filter(pl.col("status") == STATUS_OK)
    for k, v in held.items():
        part = part.filter(match(k, v))
    xs = [resolved(axis, v) for v in grid.axes[axis]]
    numeric = _numeric(xs)
    gib = numeric and axis.endswith("_bytes")
    positions = [x / 2**30 for x in xs] if gib else xs if numeric else list(range(len(xs)))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for combo in itertools.product(*(grid.axes[k] for k in lines)):
        sub = part
        for k, v in zip(lines, combo, strict=True):
            sub = sub.filter(match(k, v))
        mean, lo, hi = [], [], []
        for x in xs:
            vals = [v for v in sub.filter(match(axis, x))[grid.metric].to_list()
                    if v is not None and math.isfinite(v)]
            mean.append(sum(vals) / len(vals) if vals else math.nan)
            lo.append(min(vals) if vals else math.nan)
            hi.append(max(vals) if vals else math.nan)
        if all(math.isnan(v) for v in mean):
            continue
        label = ", ".join(f"{k}={set_text(v)}" for k, v in zip(lines, combo, strict=True))
        ax.plot(positions, mean, marker="o", label=label or grid.metric)
        if grid.seeds is not None and len(grid.seeds) > 1:
            ax.fill_between(positions, lo, hi, alpha=0.2)
    if not numeric:
        ax.set_xticks(positions, [set_text(x) for x in xs])
    ax.set_xlabel(f"{axis} (GiB)" if gib else axis)
    ax.set_ylabel(grid.metric)
    ax.set_ylim(bottom=0)
    title = f"{grid.name}: {grid.metric} vs {axis}"
    if held:
        title += "\n" + ", ".join(f"{k}={set_text(v)}" for k, v in held.items())
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(grid: Grid, frame, out: Path, command: str) -> list[Path]:
    """results.parquet, one PNG per axis, README.md (command, grid, results table)."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.parquet"]
    frame.write_parquet(written[0])
    for axis in grid.axes:
        png = out / f"{axis.replace('.', '_')}.png"
        plot_axis(grid, frame, axis, png)
        written.append(png)
    readme = out / "README.md"
    readme.write_text(readme_text(grid, frame, command, [p.name for p in written[1:]]))
    written.append(readme)
    return written


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.4g}"
    return str(value)


def readme_text(grid: Grid, frame, command: str, pngs: list[str]) -> str:
    axes = list(grid.axes) + (["seed"] if grid.seeds is not None else [])
    shown = ["decode_tok_s", "blocked_ms_per_step", "loads_per_step", "cold_fraction",
             "mib_per_step", "page_cache_bytes"]
    ok = frame.filter(frame["status"] == STATUS_OK).height
    lines = [
        f"# Sweep {grid.name}",
        "",
        grid.description or "",
        "",
        f"Produced by `{command}` from `{grid.source}` (base scenario `{grid.scenario}`"
        + (f", fixed `--set {' '.join(grid.sets)}`" if grid.sets else "")
        + (f", routing replayed from `{grid.trace}`" if grid.trace else ", synthetic routing")
        + f"). {frame.height} points, {ok} ok, {frame.height - ok} failed.",
        "",
        "Files: `results.parquet` (one row per point: axis values, status, error, every "
        "`trace summary` metric and the simulator figures), "
        + ", ".join(f"`{p}`" for p in pngs) + f" ({grid.metric} against each axis).",
        "",
        "| " + " | ".join(axes + ["status"] + shown) + " |",
        "|" + "---|" * (len(axes) + 1 + len(shown)),
    ]
    for r in frame.iter_rows(named=True):
        cells = [_cell(r[a]) for a in axes] + [r["status"] if r["error"] is None
                                               else f"failed: {r['error']}"]
        cells += [_cell(r[k] / 2**30 if k.endswith("_bytes") and r[k] is not None else r[k])
                  for k in shown]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "(page_cache_bytes in GiB.)", ""]
    return "\n".join(lines)
