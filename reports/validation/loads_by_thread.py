"""Measured vs simulated expert loads of validation configurations, by thread and cold/warm:
loads per decode step, median and mean duration, time queued before a thread started the load,
and the main thread's mean wait; and the median delay from a load's issue to its start on a
reader thread that was idle (its wake-up, sim.reader_threads). Prints a table per configuration;
writes loads_by_thread.json.

    uv run python reports/validation/loads_by_thread.py hot-pc25-unthrottled staged-pc25-unthrottled
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from contract.errors import BadInput  # noqa: E402
from sim.compare import reader_start_ms  # noqa: E402
from traces.reader import Trace, read_trace  # noqa: E402

HERE = Path(__file__).resolve().parent


def by_thread(t: Trace) -> list[dict]:
    decode = t.steps.filter(pl.col("phase") == "decode")["step"]
    loads = t.loads.filter(pl.col("step").is_in(decode.implode()) & (pl.col("expert") >= 0))
    loads = loads.with_columns(
        ((pl.col("finished_ns") - pl.col("started_ns")) / 1e6).alias("ms"),
        ((pl.col("started_ns") - pl.col("issued_ns")) / 1e6).alias("queued_ms"),
        (pl.col("thread").str.starts_with("reader").cast(pl.Utf8)).alias("reader"))
    rows = loads.group_by(["cold", "reader"]).agg(
        pl.len().alias("n"), pl.col("ms").median().alias("ms_p50"),
        pl.col("ms").mean().alias("ms_mean"), pl.col("queued_ms").mean().alias("queued_ms"),
        (pl.col("wait_ns").mean() / 1e6).alias("wait_ms")).sort(["cold", "reader"])
    return [{**r, "per_step": r.pop("n") / decode.len(),
             "thread": "reader" if r.pop("reader") == "true" else "main"}
            for r in rows.to_dicts()]


def main(names: list[str]) -> None:
    out = {}
    for name in names:
        out[name] = {}
        for kind in ("traces", "simulated"):
            path = HERE / kind / name
            try:
                trace = read_trace(path)
                out[name][kind] = by_thread(trace)
                wake = reader_start_ms(trace)
            except (BadInput, OSError) as err:
                sys.exit(str(err) if str(path) in str(err) else f"{path}: {err}")
            out[name][f"{kind}_idle_reader_start_ms"] = wake
            print(f"{name} ({'measured' if kind == 'traces' else 'simulated'})")
            print("  thread  cold  loads/step  ms p50  ms mean  queued ms  wait ms")
            for r in out[name][kind]:
                print(f"  {r['thread']:<7} {str(r['cold']):<5} {r['per_step']:10.2f} "
                      f"{r['ms_p50']:7.3f} {r['ms_mean']:8.3f} {r['queued_ms']:10.3f} "
                      f"{r['wait_ms']:8.3f}")
            if wake is not None:
                print(f"  an idle reader's start after the load's issue: {wake:.3f} ms (median)")
    (HERE / "loads_by_thread.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {HERE / 'loads_by_thread.json'}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["hot-pc25-unthrottled", "staged-pc25-unthrottled"])
