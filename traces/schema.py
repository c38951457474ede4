"""The trace schema, defined once. The engine writes it, the simulator writes it too (a simulated
run is a trace), and `trace summary`, `trace export` and `sim compare` read it. No MLX here.

A trace is a directory:
  run.json          RunInfo: model, engine config, machine, packages, command, completeness
  steps.parquet     one row per forward step
  routing.parquet   one row per (step, layer, token)
  loads.parquet     one row per expert load (or whole-layer read)
Times are monotonic nanoseconds (time.perf_counter_ns) from one clock per trace.
"""

from __future__ import annotations

import polars as pl

SCHEMA_VERSION = 1

RUN_FILE = "run.json"
STEPS_FILE = "steps.parquet"
ROUTING_FILE = "routing.parquet"
LOADS_FILE = "loads.parquet"

PHASES = ("prefill", "decode")
ROUTING_SOURCES = ("router", "prediction")
LOAD_SOURCES = ("demand", "prefetch", "whole_layer")
WHOLE_LAYER_EXPERT = -1  # `expert` value of a load that read a whole layer's tensors

STEP_COLUMNS: dict[str, pl.DataType] = {
    "step": pl.Int64(),  # 0-based, global across requests in one trace
    "request": pl.Int32(),  # prompt index within a capture; 0 for a single generate
    "phase": pl.Utf8(),  # one of PHASES
    "tokens": pl.Int32(),  # tokens processed by this forward step
    "start_ns": pl.Int64(),
    "end_ns": pl.Int64(),
    "build_ns": pl.Int64(),  # main thread building the lazy graph (python + MLX graph)
    "eval_ns": pl.Int64(),  # main thread inside mx.eval, net of waits on loads
    "blocked_ns": pl.Int64(),  # main thread blocked waiting on expert loads
    "bytes_read": pl.Int64(),  # expert bytes read from files during the step
    "loads": pl.Int32(),
    "cold_loads": pl.Int32(),
    "cache_hits": pl.Int32(),  # app-cache (hot LRU / staged slot) hits; 0 when no cache
    "cache_misses": pl.Int32(),
    "cache_evictions": pl.Int32(),
    "mlx_active_bytes": pl.Int64(),
    "mlx_peak_bytes": pl.Int64(),
    "rss_bytes": pl.Int64(),
    "page_cache_bytes": pl.Int64(),  # resident bytes of the expert files (mincore), -1 unknown
}

ROUTING_COLUMNS: dict[str, pl.DataType] = {
    "step": pl.Int64(),
    "layer": pl.Int16(),
    "token": pl.Int32(),  # position within the step (0 for a decode step)
    "experts": pl.List(pl.Int16()),  # the K experts the layer executed
    "weights": pl.List(pl.Float32()),
    "source": pl.Utf8(),  # one of ROUTING_SOURCES
    "router_experts": pl.List(pl.Int16()),  # the layer's own router top-K when computed, else null
}

LOAD_COLUMNS: dict[str, pl.DataType] = {
    "step": pl.Int64(),
    "layer": pl.Int16(),
    "expert": pl.Int32(),  # WHOLE_LAYER_EXPERT for a whole-layer read
    "bytes": pl.Int64(),
    "offset": pl.Int64(),  # byte offset of the first range in the layer file
    "issued_ns": pl.Int64(),  # request created
    "started_ns": pl.Int64(),  # reader began the read
    "finished_ns": pl.Int64(),
    "source": pl.Utf8(),  # one of LOAD_SOURCES
    "cold": pl.Boolean(),  # bytes not in the page cache before the read (mincore)
    "waited": pl.Boolean(),  # main thread blocked on this load
    "wait_ns": pl.Int64(),  # how long it blocked
    "thread": pl.Utf8(),  # "main" or reader name
}

TABLES: dict[str, dict[str, pl.DataType]] = {
    STEPS_FILE: STEP_COLUMNS,
    ROUTING_FILE: ROUTING_COLUMNS,
    LOADS_FILE: LOAD_COLUMNS,
}

# Metric names shared by `trace summary --json` and `sim run --json` (same names, same units).
SUMMARY_KEYS: tuple[str, ...] = (
    "decode_tok_s",
    "prefill_tok_s",
    "step_ms_p10",
    "step_ms_p50",
    "step_ms_p90",
    "blocked_ms_per_step",
    "loads_per_step",
    "mib_per_load",
    "cold_fraction",
    "mib_per_step",
    "adjacent_overlap",
    "load_entropy",
    "peak_mlx_bytes",
    "peak_rss_bytes",
)


def empty_frame(columns: dict[str, pl.DataType]) -> pl.DataFrame:
    return pl.DataFrame(schema=columns)
