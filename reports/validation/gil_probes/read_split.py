"""Reader threads' cold reads by source and whether the main thread waited, measured vs
simulated, per configuration of reports/validation (the polars query behind the GIL section of
the top README):

    uv run python reports/validation/gil_probes/read_split.py staged-layer-pc25-unthrottled
"""
import json
import sys
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[3]
for cfg in sys.argv[1:]:
    d = json.load(open(ROOT / f"reports/validation/results/{cfg}.json"))
    for tag, p in (("meas", d["trace"]), ("sim", d["simulated_trace"])):
        loads = pl.read_parquet(str(ROOT / p / "loads") + "/*.parquet").filter(
            pl.col("cold") & ~pl.col("thread").str.starts_with("main")
        )
        read_ms = (pl.col("finished_ns") - pl.col("started_ns")) / 1e6
        loads = loads.with_columns(read_ms.alias("r"))
        g = (
            loads.group_by(["source", "waited"])
            .agg(
                pl.len().alias("n"),
                pl.col("r").median().alias("p50"),
                pl.col("r").quantile(0.9).alias("p90"),
            )
            .sort(["source", "waited"])
        )
        print(
            cfg,
            tag,
            [
                (r["source"][:4], r["waited"], r["n"], round(r["p50"], 2), round(r["p90"], 2))
                for r in g.iter_rows(named=True)
            ],
        )
