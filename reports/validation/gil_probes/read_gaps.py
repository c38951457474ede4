"""A decode step's cold expert reads in the committed report's traces (every round of each
configuration named), their mean and median ms by the gap since the previous cold read ended
(any thread) and by the time since the same bundle was last read (null: its first read).

    uv run python reports/validation/gil_probes/read_gaps.py \
        on-demand-pc50-unthrottled on-demand-pc25-unthrottled
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl

TRACES = Path(__file__).resolve().parents[1] / "traces"


def cold_reads(config: str) -> pl.DataFrame:
    parts = []
    for t in sorted(TRACES.glob(f"{config}")) + sorted(TRACES.glob(f"{config}.r*")):
        loads = pl.read_parquet(t / "loads").filter(pl.col("expert") >= 0).sort("started_ns")
        steps = pl.read_parquet(t / "steps").filter(pl.col("phase") == "decode")["step"]
        loads = loads.with_columns(
            ((pl.col("started_ns") - pl.col("finished_ns").shift(1).over(["layer", "expert"]))
             / 1e6).alias("since_bundle_ms"))
        cold = loads.filter(pl.col("step").is_in(steps.implode()) & pl.col("cold"))
        finished = cold["finished_ns"].to_numpy()
        before = np.r_[np.nan, np.maximum.accumulate(finished)[:-1]]
        parts.append(cold.select(
            ((pl.col("finished_ns") - pl.col("started_ns")) / 1e6).alias("ms"),
            pl.Series("gap_ms", (cold["started_ns"].to_numpy() - before) / 1e6),
            "since_bundle_ms"))
    return pl.concat(parts)


def table(d: pl.DataFrame, column: str, edges: list[float]) -> pl.DataFrame:
    return (d.with_columns(pl.col(column).cut(edges).alias(column + " (bin)"))
            .group_by(column + " (bin)")
            .agg(pl.len().alias("reads"), pl.col("ms").mean().round(3).alias("mean ms"),
                 pl.col("ms").median().round(3).alias("median ms"))
            .sort(column + " (bin)"))


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("read_gaps.py: name one or more configurations (reports/validation/traces)")
    pl.Config.set_tbl_rows(20)
    for config in sys.argv[1:]:
        if not (TRACES / config).is_dir():
            sys.exit(f"read_gaps.py: {TRACES / config}: no such trace")
        d = cold_reads(config)
        print(f"{config}: {d.height} cold reads, mean {d['ms'].mean():.3f} ms")
        print(table(d, "gap_ms", [0.02, 0.1, 0.5, 2, 10]))
        print(table(d, "since_bundle_ms", [20, 50, 100, 200, 500, 1000, 3000]))


if __name__ == "__main__":
    main()
