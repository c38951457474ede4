"""Turn a finished simulation into trace tables (traces.schema), so `trace summary`, `trace
export --chrome` and comparisons read simulated runs exactly like measured ones.

A load read as p pieces becomes p load rows (bytes split, times split evenly; with readahead only
the first piece of a cold bundle is cold); the main thread's wait goes on the last piece, which
ends when the load does. Step counters (loads, cold loads, bytes) count the loads issued in the
step. Memory columns are the engine's allocation model (sim.memory_budget), rss is unknown (-1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from sim.loads import Load
from sim.memory_budget import MemoryBudget
from traces.schema import LOAD_COLUMNS, ROUTING_COLUMNS, STEP_COLUMNS


class StepLog:
    """Per-step columns (the rest of the steps table is derived from the load log)."""

    def __init__(self) -> None:
        self.cols: dict[str, list[Any]] = {name: [] for name in (
            "step", "request", "phase", "tokens", "start", "end", "build", "eval", "blocked",
            "hits", "misses", "evictions", "lru_bytes", "page_cache_bytes", "cpu", "main_cpu",
            "reader_cpu")}

    def add(self, **row: Any) -> None:
        for name, value in row.items():
            self.cols[name].append(value)


def _ns(seconds: np.ndarray | list[float]) -> np.ndarray:
    return np.rint(np.asarray(seconds, dtype=np.float64) * 1e9).astype(np.int64)


def loads_frame(loads: list[Load], readahead: bool) -> pl.DataFrame:
    if not loads:
        return pl.DataFrame(schema=LOAD_COLUMNS)
    n = len(loads)
    pieces = np.fromiter((ld.pieces if ld.expert >= 0 else 1 for ld in loads), np.int64, n)
    col = {name: [getattr(ld, name) for ld in loads] for name in (
        "step", "layer", "expert", "nbytes", "issued", "started", "finished", "source", "cold",
        "cold_pieces", "waited", "wait", "thread")}
    idx = np.repeat(np.arange(n), pieces)
    first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
    piece = np.arange(len(idx)) - np.repeat(first, pieces)  # 0..p-1 within each load
    p = pieces[idx]
    nbytes = np.asarray(col["nbytes"], dtype=np.int64)[idx]
    base, rem = nbytes // p, nbytes % p
    piece_bytes = base + (piece < rem)
    offset_in = base * piece + np.minimum(piece, rem)
    started = np.asarray(col["started"])[idx]
    finished = np.asarray(col["finished"])[idx]
    span = (finished - started) / p
    p_start, p_end = started + span * piece, started + span * (piece + 1)
    cold_pieces = np.asarray(col["cold_pieces"])[idx]
    cold = piece < cold_pieces if readahead else np.asarray(col["cold"])[idx]
    last = piece == p - 1
    waited = np.asarray(col["waited"])[idx] & last
    wait = np.where(last, _ns(np.asarray(col["wait"])[idx]), 0)
    expert = np.asarray(col["expert"], dtype=np.int64)[idx]
    layer = np.asarray(col["layer"], dtype=np.int64)[idx]
    offset = np.where(expert >= 0, expert, 0) * np.where(expert >= 0, nbytes, 0) + offset_in
    frame = pl.DataFrame({
        "step": np.asarray(col["step"], dtype=np.int64)[idx],
        "layer": layer,
        "expert": expert,
        "bytes": piece_bytes,
        "offset": offset,
        "issued_ns": _ns(np.asarray(col["issued"])[idx]),
        "started_ns": _ns(p_start),
        "finished_ns": _ns(p_end),
        "source": np.asarray(col["source"])[idx],
        "cold": cold,
        "waited": waited,
        "wait_ns": wait,
        "thread": np.asarray(col["thread"])[idx],
    })
    return frame.select(pl.col(c).cast(t) for c, t in LOAD_COLUMNS.items())


def steps_frame(log: StepLog, loads: pl.DataFrame, memory: MemoryBudget,
                kv_bytes_per_token: int, context_tokens: int) -> pl.DataFrame:
    c = log.cols
    n = len(c["step"])
    steps = np.asarray(c["step"], dtype=np.int64)
    per_step = (
        loads.group_by("step").agg(
            pl.col("bytes").sum().alias("bytes_read"),
            pl.len().alias("loads"),
            pl.col("cold").sum().alias("cold_loads"),
        )
        if loads.height else pl.DataFrame(schema={"step": pl.Int64, "bytes_read": pl.Int64,
                                                  "loads": pl.UInt32, "cold_loads": pl.UInt32})
    )
    # KV grows with tokens processed; the rest of the engine allocation is fixed by the budget,
    # except the bundle LRU, which holds what it has filled so far.
    tokens = np.cumsum(np.asarray(c["tokens"], dtype=np.int64)) + context_tokens
    fixed = memory.engine - memory.kv - memory.lru
    active = fixed + tokens * kv_bytes_per_token + np.asarray(c["lru_bytes"], dtype=np.int64)
    is_prefill = np.asarray(c["phase"]) == "prefill"
    peak = active + np.where(is_prefill, memory.prefill_buffers, 0)
    frame = pl.DataFrame({
        "step": steps,
        "request": np.asarray(c["request"], dtype=np.int64),
        "phase": c["phase"],
        "tokens": np.asarray(c["tokens"], dtype=np.int64),
        "start_ns": _ns(c["start"]),
        "end_ns": _ns(c["end"]),
        "build_ns": _ns(c["build"]),
        "eval_ns": _ns(c["eval"]),
        "blocked_ns": _ns(c["blocked"]),
        "cache_hits": np.asarray(c["hits"], dtype=np.int64),
        "cache_misses": np.asarray(c["misses"], dtype=np.int64),
        "cache_evictions": np.asarray(c["evictions"], dtype=np.int64),
        "mlx_active_bytes": active,
        "mlx_peak_bytes": peak,
        "rss_bytes": np.full(n, -1, dtype=np.int64),
        "page_cache_bytes": np.asarray(c["page_cache_bytes"], dtype=np.int64),
        "cpu_ns": _ns(c["cpu"]),
        "main_cpu_ns": _ns(c["main_cpu"]),
        "reader_cpu_ns": _ns(c["reader_cpu"]),
    })
    frame = frame.join(per_step, on="step", how="left").with_columns(
        pl.col("bytes_read").fill_null(0), pl.col("loads").fill_null(0),
        pl.col("cold_loads").fill_null(0))
    return frame.select(pl.col(c).cast(t) for c, t in STEP_COLUMNS.items())


def routing_frame(executed: np.ndarray, router: np.ndarray, staged: np.ndarray,
                  plan_steps: np.ndarray, hinted: list[dict[int, list[int]]] | None = None
                  ) -> pl.DataFrame:
    """One row per decode (step, layer): executed experts; staged layers have source
    "prediction" and the router's own set in router_experts; `hinted` (per decode step,
    {layer: experts}) the sets a first-layer hint read ahead."""
    rows, layers, k = executed.shape
    if rows == 0:
        return pl.DataFrame(schema=ROUTING_COLUMNS)
    lists = pl.List(pl.Int16())
    staged_flat = np.tile(staged, rows)
    router_flat = router.reshape(-1, k)
    frame = pl.DataFrame({
        "step": np.repeat(plan_steps, layers),
        "layer": np.tile(np.arange(layers), rows),
        "token": np.zeros(rows * layers, dtype=np.int64),
        "experts": pl.Series(executed.reshape(-1, k)).cast(lists),
        "source": np.where(staged_flat, "prediction", "router"),
        "_staged": staged_flat,
        "_router": pl.Series(router_flat).cast(lists),
    }).with_columns(
        pl.when(pl.col("_staged")).then(pl.col("_router")).otherwise(None).alias(
            "router_experts"),
        pl.lit(None, dtype=pl.List(pl.Float32())).alias("weights"),
    )
    hints = [(hinted[r].get(layer) if hinted else None) for r in range(rows)
             for layer in range(layers)]
    frame = frame.with_columns(pl.Series("hinted_experts", hints, dtype=lists))
    return frame.select(pl.col(c).cast(t) for c, t in ROUTING_COLUMNS.items())
