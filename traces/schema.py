"""The trace schema, defined once. The engine writes it, the simulator writes it too (a simulated
run is a trace), and `trace summary`, `trace export` and `sim compare` read it. No MLX here.

A trace is a directory:
  run.json          RunInfo: model, engine config, machine, packages, command, completeness
  steps/            one row per forward step
  routing/          one row per (step, layer, token)
  loads/            one row per expert load (or whole-layer read)
Times are monotonic nanoseconds (time.perf_counter_ns) from one clock per trace.

Each table is a directory of parquet parts (schema version 2): `NNNNNN.parquet` holds the rows
one flush added, and `NNNNNN-MMMMMM.parquet` the parts N..M merged when the capture closed.
A part is written whole under a dot-name and renamed, so a reader sees whole parts only; a
merged part stands for the parts it covers (a capture killed while merging leaves both). The
table is its parts in order: any parquet reader opens the directory (`pl.read_parquet(
"steps/*.parquet")`). Version 1 (one file per table, `steps.parquet`, rewritten at each flush)
is still read.
"""

from __future__ import annotations

import polars as pl

SCHEMA_VERSION = 2

RUN_FILE = "run.json"
STEPS, ROUTING, LOADS = "steps", "routing", "loads"  # table directories (version 2)
STEPS_FILE = "steps.parquet"  # version 1: one file per table
ROUTING_FILE = "routing.parquet"
LOADS_FILE = "loads.parquet"

PHASES = ("prefill", "decode")
ROUTING_SOURCES = ("router", "prediction")
DEMAND, PREFETCH, WHOLE_LAYER = "demand", "prefetch", "whole_layer"  # load sources
LOAD_SOURCES = (DEMAND, PREFETCH, WHOLE_LAYER)
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
    "cpu_ns": pl.Int64(),  # CPU time of every thread of the process since the previous row
    "main_cpu_ns": pl.Int64(),  # the main thread's CPU time since the previous row
    "reader_cpu_ns": pl.Int64(),  # the reader threads' CPU time since the previous row
}
# columns added after traces were first written, and what a trace without them reads them as
# (-1: unknown; null: none)
LATER_COLUMNS: dict[str, int | None] = {"cpu_ns": -1, "main_cpu_ns": -1, "reader_cpu_ns": -1,
                                         "hinted_experts": None}

ROUTING_COLUMNS: dict[str, pl.DataType] = {
    "step": pl.Int64(),
    "layer": pl.Int16(),
    "token": pl.Int32(),  # position within the step (0 for a decode step)
    "experts": pl.List(pl.Int16()),  # the K experts the layer executed
    "weights": pl.List(pl.Float32()),
    "source": pl.Utf8(),  # one of ROUTING_SOURCES
    "router_experts": pl.List(pl.Int16()),  # the layer's own router top-K when computed, else null
    # experts read ahead from the step's token before this layer routed (a first-layer hint,
    # engine.first_layer_hint: what the table gave, before any cap for room), else null
    "hinted_experts": pl.List(pl.Int16()),
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
    STEPS: STEP_COLUMNS,
    ROUTING: ROUTING_COLUMNS,
    LOADS: LOAD_COLUMNS,
}
V1_FILES = {STEPS: STEPS_FILE, ROUTING: ROUTING_FILE, LOADS: LOADS_FILE}


def part_name(first: int, last: int | None = None) -> str:
    """`NNNNNN.parquet` (one flush's rows), or `NNNNNN-MMMMMM.parquet` (parts first..last
    merged)."""
    return f"{first:06d}.parquet" if last is None else f"{first:06d}-{last:06d}.parquet"


def parse_part(name: str) -> tuple[int, int] | None:
    """(first, last) part numbers of a part file name; None for anything else (temp files)."""
    if name.startswith(".") or not name.endswith(".parquet"):
        return None
    stem = name[: -len(".parquet")].split("-")
    try:
        nums = [int(x) for x in stem]
    except ValueError:
        return None
    if len(nums) == 1:
        return nums[0], nums[0]
    return (nums[0], nums[1]) if len(nums) == 2 and nums[0] <= nums[1] else None


def live_parts(names: list[str]) -> list[str]:
    """The part files that make up a table, in order: every merged part, and every single part
    that no merged part covers."""
    parts = [(r, n) for n in names if (r := parse_part(n)) is not None]
    merged = [r for r, _ in parts if r[0] != r[1]]
    keep = [(r, n) for r, n in parts
            if r[0] != r[1] or not any(a <= r[0] <= b for a, b in merged)]
    return [n for _, n in sorted(keep)]

# Metric names shared by `trace summary --json` and `sim run --json` (same names, same units).
SUMMARY_KEYS: tuple[str, ...] = (
    "decode_tok_s",
    "prefill_tok_s",
    "step_ms_p10",
    "step_ms_p50",
    "step_ms_p90",
    "blocked_ms_per_step",
    "cpu_ms_per_step",
    "main_cpu_ms_per_step",
    "reader_cpu_ms_per_step",
    "loads_per_step",
    "mib_per_load",
    "cold_fraction",
    "cache_hit_rate",
    "mib_per_step",
    "adjacent_overlap",
    "load_entropy",
    "peak_mlx_bytes",
    "peak_rss_bytes",
)


def empty_frame(columns: dict[str, pl.DataType]) -> pl.DataFrame:
    return pl.DataFrame(schema=columns)
