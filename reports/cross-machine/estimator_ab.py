"""The table of estimator_ab.sh: for each calibration (this checkout's, "new", and BASE's,
"old", taken in turns), what its profile charges for a load of the wide model's bundle, the
same-machine matrix's held-out error after the in-decode fits, and each transfer run's
errors (decode tok/s, its components, and the CPU of the main thread and of the others per
step); beside them what those loads cost inside decode in each transfer run (its wide model's
on-demand points: every load there is on the main thread, so its time is what decode paid).

Usage: uv run python reports/cross-machine/estimator_ab.py OUT TRANSFER_RUN...  (estimator_ab.sh
calls it); writes OUT/estimator-ab.json."""

from __future__ import annotations

import json
import statistics
import sys
import tomllib
from pathlib import Path

import polars as pl

WIDE = "tiny-trained-wide-stream"


def load_charge_ms(hw: dict, nbytes: int) -> tuple[float, float]:
    """(cold, warm) ms of one load of `nbytes` by the profile's closed form (sim.loads, an idle
    device and free cores): warm = per-read work + copy; cold adds the device's latency and
    transfer and the page-cache fill work."""
    warm = hw["load_overhead_ms"] + (nbytes / (hw["memcpy_gbps"] * 1e9) * 1e3
                                     if hw["memcpy_gbps"] else 0.0)
    cold = (warm + hw["ssd_latency_ms"] + nbytes / (hw["ssd_bandwidth_gbps"] * 1e9) * 1e3
            + hw["cold_overhead_ms"])
    return cold, warm


def measured_loads(run: Path) -> dict:
    """Mean cold and warm load time (ms) and bundle bytes over the wide model's on-demand
    decode steps of a transfer run, every round and unthrottled machine (a read throttle's
    waits are inside its loads' times)."""
    rows = []
    for trace in sorted((run / "traces" / WIDE).glob("*/on-demand.r*")):
        if json.loads((trace / "run.json").read_text())["extra"].get("throttle"):
            continue
        steps = pl.read_parquet(sorted((trace / "steps").glob("*.parquet")))
        decode = steps.filter(pl.col("phase") == "decode")["step"]
        loads = pl.read_parquet(sorted((trace / "loads").glob("*.parquet")))
        rows.append(loads.filter(pl.col("step").is_in(decode.implode())))
    loads = pl.concat(rows).with_columns(
        ms=(pl.col("finished_ns") - pl.col("started_ns")) / 1e6)
    return {"bundle_bytes": int(loads["bytes"].max()),
            "cold_ms": float(loads.filter(pl.col("cold"))["ms"].mean()),
            "warm_ms": float(loads.filter(~pl.col("cold"))["ms"].mean())}


def cpu_split_errors(results: list[dict]) -> dict:
    """Median absolute % error, over a transfer run's points, of the main thread's CPU per
    decode step and of the other threads' (the compute thread and the readers)."""
    def pair(r: dict) -> tuple[tuple[float, float], tuple[float, float]]:
        cpu, main = r["cpu_ms_per_step"], r["main_cpu_ms_per_step"]
        return ((main["measured"], main["simulated"]),
                (cpu["measured"] - main["measured"], cpu["simulated"] - main["simulated"]))

    def median_ape(pairs: list[tuple[float, float]]) -> float:
        return statistics.median(abs(s / m - 1) * 100 for m, s in pairs if m > 0)

    pairs = [pair(r) for r in results]
    return {"main_cpu_abs_error_median_pct": median_ape([p[0] for p in pairs]),
            "other_cpu_abs_error_median_pct": median_ape([p[1] for p in pairs])}


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: estimator_ab.py OUT TRANSFER_RUN...")
    out, runs = Path(sys.argv[1]), [Path(r) for r in sys.argv[2:]]
    for need in [out / "cal-new-1" / "hardware.toml", *(r / "traces" / WIDE for r in runs)]:
        if not need.exists():
            raise SystemExit(f"estimator_ab.py: {need}: missing (run estimator_ab.sh first)")
    measured = {r.name: measured_loads(r) for r in runs}
    nbytes = next(iter(measured.values()))["bundle_bytes"]
    rows = []
    for cal in sorted(out.glob("cal-*-*"), key=lambda p: (p.name.split("-")[2], p.name)):
        hw = tomllib.loads((cal / "hardware.toml").read_text())
        cold, warm = load_charge_ms(hw, nbytes)
        matrix = json.loads((cal / "matrix" / "validation.json").read_text())["summary"]
        row = {"calibration": cal.name, "when": json.loads(
                   (cal / "calibration.json").read_text())["when"],
               "charged_cold_ms": cold, "charged_warm_ms": warm,
               "matrix_median_pct": matrix["decode_tok_s"]["median_ape_pct"],
               "matrix_p90_pct": matrix["decode_tok_s"]["p90_ape_pct"], "transfer": {}}
        for r in runs:
            doc = json.loads((cal / f"transfer-{r.name}" / "transfer.json").read_text())
            s = doc["summary"]
            row["transfer"][r.name] = {k: s[k] for k in (
                "decode_abs_error_median_pct", "decode_abs_error_p90_pct",
                "component_abs_error_median_pct")} | cpu_split_errors(doc["results"])
        rows.append(row)
    doc = {"bundle_bytes": nbytes, "measured_in_decode": measured, "calibrations": rows}
    (out / "estimator-ab.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"a {nbytes}-byte load inside decode (mean over the wide model's unthrottled "
          "on-demand points):")
    for name, m in measured.items():
        print(f"  {name}: cold {m['cold_ms']:.2f} ms, warm {m['warm_ms']:.3f} ms")
    head = "| calibration | when | charged cold / warm ms | matrix median / p90 % |"
    head += "".join(f" {r.name}: median / p90 / components / main CPU / other CPU % |"
                    for r in runs)
    print(head)
    print("|" + "---|" * (4 + len(runs)))
    for row in rows:
        cells = [row["calibration"], row["when"],
                 f"{row['charged_cold_ms']:.2f} / {row['charged_warm_ms']:.3f}",
                 f"{row['matrix_median_pct']:.1f} / {row['matrix_p90_pct']:.1f}"]
        cells += [" / ".join(f"{t[k]:.1f}" for k in t) for t in row["transfer"].values()]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
