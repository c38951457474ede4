"""Summary metrics of a trace: the numbers `ssdmoe trace summary` prints and `sim run` reports
under the same names (traces.schema.SUMMARY_KEYS). No MLX here.

Definitions (decode = steps with phase "decode"; routing and loads are joined to steps by `step`):
  decode_tok_s          sum(decode tokens) / sum(decode step durations end_ns - start_ns)
  prefill_tok_s         the same over prefill steps
  step_ms_p10/p50/p90   percentiles (numpy "linear") of decode step durations, ms
  blocked_ms_per_step   mean blocked_ns of decode steps, ms
  cpu_ms_per_step       mean cpu_ns of decode steps (every thread of the process), ms
  main_cpu_ms_per_step  mean main_cpu_ns of decode steps (the main thread), ms
  reader_cpu_ms_per_step  mean reader_cpu_ns of decode steps (every reader thread), ms
  loads_per_step        mean `loads` of decode steps (the steps table's counters)
  mib_per_load          sum(bytes_read) / sum(loads) over decode steps, MiB
  cold_fraction         sum(cold_loads) / sum(loads) over decode steps
  cache_hit_rate        sum(cache_hits) / sum(cache_hits + cache_misses) over decode steps: the
                        app cache's (hot pool, staged slots); None where nothing was looked up
  mib_per_step          mean bytes_read of decode steps, MiB
  adjacent_overlap      mean over layers of the layer's adjacent-token overlap of the experts
                        it executed at decode (`experts` column, whatever its source), tokens in
                        (step, token) order within each request, never across requests
  load_entropy          mean over layers of the normalised entropy of the decode expert loads
                        (n_experts = run.json model.experts)
  peak_mlx_bytes        max of mlx_peak_bytes / mlx_active_bytes over all steps
  peak_rss_bytes        max rss_bytes over all steps
Anything that cannot be computed (no such steps, a null column, -1 "unknown") is None.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl

from contract.errors import BadInput
from traces.reader import Trace
from traces.routing_stats import adjacent_overlap, load_entropy
from traces.schema import ROUTING_FILE, SUMMARY_KEYS

MIB = 1 << 20

# key -> (label, unit) for printing; the unit is what the number is in.
METRIC_INFO: dict[str, tuple[str, str]] = {
    "decode_tok_s": ("decode", "tok/s"),
    "prefill_tok_s": ("prefill", "tok/s"),
    "step_ms_p10": ("decode step p10", "ms"),
    "step_ms_p50": ("decode step p50", "ms"),
    "step_ms_p90": ("decode step p90", "ms"),
    "blocked_ms_per_step": ("blocked on loads", "ms/step"),
    "cpu_ms_per_step": ("CPU, every thread", "ms/step"),
    "main_cpu_ms_per_step": ("CPU, main thread", "ms/step"),
    "reader_cpu_ms_per_step": ("CPU, reader threads", "ms/step"),
    "loads_per_step": ("loads", "loads/step"),
    "mib_per_load": ("size per load", "MiB/load"),
    "cold_fraction": ("cold loads", "fraction"),
    "cache_hit_rate": ("app-cache hit rate", "fraction"),
    "mib_per_step": ("bytes read", "MiB/step"),
    "adjacent_overlap": ("adjacent-token overlap", "fraction"),
    "load_entropy": ("expert-load entropy", "normalised"),
    "peak_mlx_bytes": ("peak MLX memory", "bytes"),
    "peak_rss_bytes": ("peak RSS", "bytes"),
}

Summary = dict[str, float | int | None]


def _num(value: Any) -> float | None:
    """A finite float or None (polars gives None for empty/all-null aggregates)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _ratio(num: Any, den: Any) -> float | None:
    num, den = _num(num), _num(den)
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _phase(trace: Trace, phase: str) -> pl.DataFrame:
    return trace.steps.filter(pl.col("phase") == phase)


def _tok_s(steps: pl.DataFrame) -> float | None:
    timed = steps.filter(pl.col("start_ns").is_not_null() & pl.col("end_ns").is_not_null())
    if timed.height == 0:
        return None
    wall_ns = (timed["end_ns"] - timed["start_ns"]).sum()
    return _ratio(timed["tokens"].sum() * 1e9, wall_ns)


def _peak(steps: pl.DataFrame, columns: tuple[str, ...]) -> int | None:
    peaks = [steps[c].filter(steps[c] >= 0).max() for c in columns]  # -1 means unknown
    peaks = [p for p in peaks if p is not None]
    return int(max(peaks)) if peaks else None


def _decode_routing(trace: Trace) -> pl.DataFrame:
    """Decode routing rows with their request, in token order."""
    keys = trace.steps.filter(pl.col("phase") == "decode").select("step", "request")
    routing = (
        trace.routing.filter(pl.col("experts").is_not_null())
        .join(keys, on="step", how="inner")
        .sort("request", "step", "token")
    )
    # One row per (step, layer, token) is the schema's contract; two would pair a token with
    # itself in the overlap, so refuse rather than guess which one the layer executed.
    dup = routing.select("step", "layer", "token").is_duplicated()
    if dup.any():
        first = routing.filter(dup).row(0, named=True)
        raise BadInput(f"{trace.path / ROUTING_FILE}: several rows for step {first['step']} "
                       f"layer {first['layer']} token {first['token']}")
    return routing


def _topk(experts: pl.Series, layer: int, trace: Trace) -> np.ndarray:
    lengths = experts.list.len()
    k = int(lengths.max() or 0)
    if k == 0 or int(lengths.min()) != k:
        raise BadInput(
            f"{trace.path / ROUTING_FILE}: layer {layer} has expert lists of different lengths"
        )
    return experts.list.to_array(k).to_numpy().astype(np.int64, copy=False)


def _layer_routing(trace: Trace) -> pl.DataFrame:
    """Per layer: decode tokens, adjacent overlap (pairs never cross requests), load entropy."""
    routing = _decode_routing(trace)
    n_experts = (trace.run.get("model") or {}).get("experts")
    rows = []
    for (layer,), part in routing.group_by("layer", maintain_order=False):
        topk = _topk(part["experts"], int(layer), trace)
        requests = part["request"].to_numpy()
        # Overlap per request, pooled: weight each request by its number of adjacent pairs.
        pairs, weighted = 0, 0.0
        bounds = np.flatnonzero(np.diff(requests)) + 1
        for seq in np.split(topk, bounds):
            if len(seq) >= 2:
                pairs += len(seq) - 1
                weighted += adjacent_overlap(seq) * (len(seq) - 1)
        entropy = load_entropy(topk, int(n_experts)) if isinstance(n_experts, int) else None
        rows.append({
            "layer": int(layer),
            "tokens": len(topk),
            "adjacent_overlap": weighted / pairs if pairs else None,
            "load_entropy": _num(entropy),
        })
    schema = {"layer": pl.Int64, "tokens": pl.Int64, "adjacent_overlap": pl.Float64,
              "load_entropy": pl.Float64}
    return pl.DataFrame(rows, schema=schema).sort("layer")


def _layer_loads(trace: Trace) -> pl.DataFrame:
    """Per layer: decode loads, loads/step, cold fraction, ms/step the main thread waited."""
    decode = trace.steps.filter(pl.col("phase") == "decode").select("step")
    n_steps = max(decode.height, 1)  # no decode steps -> no rows below anyway
    loads = trace.loads.join(decode, on="step", how="inner")
    waited = pl.when(pl.col("waited").fill_null(False)).then(pl.col("wait_ns")).otherwise(0)
    return (
        loads.group_by("layer")
        .agg(
            pl.len().alias("loads"),
            pl.col("cold").fill_null(False).sum().alias("cold_loads"),
            waited.fill_null(0).sum().alias("wait_ns"),
        )
        .select(
            pl.col("layer").cast(pl.Int64),
            pl.col("loads").cast(pl.Int64),
            (pl.col("loads") / n_steps).cast(pl.Float64).alias("loads_per_step"),
            (pl.col("cold_loads") / pl.col("loads")).cast(pl.Float64).alias("cold_fraction"),
            (pl.col("wait_ns") / 1e6 / n_steps).cast(pl.Float64).alias("wait_ms_per_step"),
        )
    )


def summarize_layers(trace: Trace) -> pl.DataFrame:
    """One row per layer (decode only): layer, tokens, adjacent_overlap, load_entropy, loads,
    loads_per_step, cold_fraction, wait_ms_per_step. Loads come from loads.parquet; a layer
    with routing but no loads has loads 0 and a null cold fraction."""
    routing = _layer_routing(trace)
    loads = _layer_loads(trace)
    table = routing.join(loads, on="layer", how="full", coalesce=True).sort("layer")
    return table.with_columns(
        pl.col("tokens").fill_null(0),
        pl.col("loads").fill_null(0),
        pl.col("loads_per_step").fill_null(0.0),
        pl.col("wait_ms_per_step").fill_null(0.0),
    )


def cpu_by_thread(summary: dict[str, Any]) -> dict[str, float | None]:
    """A summary's decode CPU ms a step by thread, as `sim compare` splits the simulated one:
    MLX's compute thread (the process less the main and reader threads), the main thread and
    the reader threads; where the readers' CPU was not recorded (older traces, macOS) the main
    thread and the rest ("compute and readers")."""
    cpu, main, readers = (summary.get(k) for k in (
        "cpu_ms_per_step", "main_cpu_ms_per_step", "reader_cpu_ms_per_step"))
    if readers is None:
        return {"main": main, "compute and readers": None if cpu is None or main is None
                else cpu - main}
    return {"compute": None if cpu is None or main is None else cpu - main - readers,
            "main": main, "readers": readers}


def _known_mean_ms(steps: pl.DataFrame, col: str) -> float | None:
    """Mean of a column in ms over the steps that know it (-1: not recorded)."""
    known = steps[col].filter(steps[col] >= 0) if col in steps.columns else pl.Series([])
    return _ratio(known.mean(), 1e6) if len(known) else None


def summarize(trace: Trace) -> Summary:
    """The SUMMARY_KEYS metrics of a trace (see the module docstring for each definition)."""
    decode = _phase(trace, "decode")
    durations_ms = (
        (decode["end_ns"] - decode["start_ns"]).drop_nulls().to_numpy().astype(np.float64) / 1e6
    )
    if len(durations_ms):
        p10, p50, p90 = (float(v) for v in np.percentile(durations_ms, [10, 50, 90]))
    else:
        p10 = p50 = p90 = None
    layers = _layer_routing(trace)
    overlap = layers["adjacent_overlap"].drop_nulls()
    entropy = layers["load_entropy"].drop_nulls()
    out: Summary = {
        "decode_tok_s": _tok_s(decode),
        "prefill_tok_s": _tok_s(_phase(trace, "prefill")),
        "step_ms_p10": p10,
        "step_ms_p50": p50,
        "step_ms_p90": p90,
        "blocked_ms_per_step": _ratio(decode["blocked_ns"].mean(), 1e6),
        "cpu_ms_per_step": _known_mean_ms(decode, "cpu_ns"),
        "main_cpu_ms_per_step": _known_mean_ms(decode, "main_cpu_ns"),
        "reader_cpu_ms_per_step": _known_mean_ms(decode, "reader_cpu_ns"),
        "loads_per_step": _num(decode["loads"].mean()),
        "mib_per_load": _ratio(decode["bytes_read"].sum() / MIB, decode["loads"].sum())
        if decode["bytes_read"].null_count() < decode.height else None,
        "cold_fraction": _ratio(decode["cold_loads"].sum(), decode["loads"].sum())
        if decode["cold_loads"].null_count() < decode.height else None,
        "cache_hit_rate": _ratio(decode["cache_hits"].sum(),
                                 decode["cache_hits"].sum() + decode["cache_misses"].sum()),
        "mib_per_step": _ratio(decode["bytes_read"].mean(), MIB),
        "adjacent_overlap": _num(overlap.mean()) if len(overlap) else None,
        "load_entropy": _num(entropy.mean()) if len(entropy) else None,
        "peak_mlx_bytes": _peak(trace.steps, ("mlx_peak_bytes", "mlx_active_bytes")),
        "peak_rss_bytes": _peak(trace.steps, ("rss_bytes",)),
    }
    assert tuple(out) == SUMMARY_KEYS
    return out
