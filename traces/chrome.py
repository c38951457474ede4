"""Chrome trace event format export (open in https://ui.perfetto.dev or chrome://tracing).

Tracks (one process, named after the trace kind: measured / simulated / synthetic):
  main              one span per step; inside it a "build" span and an "eval" span, and inside
                    "eval" one "wait" span per load the main thread blocked on.
  main: reads       loads whose `thread` is "main" (synchronous reads), when there are any
  <reader>          one track per reader thread: one span per load, "L<layer> E<expert>"
                    ("L<layer> whole layer" for whole-layer reads), cname "bad" = cold,
                    "good" = warm; a reader whose loads overlap in time gets extra lanes
                    "<reader> [2]", ... so spans on one track always nest.
The steps table holds per-step totals of build and eval time, not their positions, so the
build span is drawn at the start of the step and the eval span at its end (stretched back to
cover every wait drawn in the step); their args carry the exact totals. With the engine's
lookahead (run.json `engine.lookahead`) a step row is a window of wall time whose build is the
NEXT step's graph, built in pieces between that window's fill points (engine.generate): there
the build span is a total, drawn first, not where the pieces happened. A wait span ends at the
load's finished_ns and lasts wait_ns; waits are clipped to their step and to each other (the
main thread blocks on one thing at a time). Times are microseconds from the trace's first event.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from traces.reader import Trace
from traces.schema import WHOLE_LAYER_EXPERT
from traces.writer import write_atomic

PID = 1
MAIN_TID = 0
MAIN_READS_TID = 1
MIB = 1 << 20


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _span(name: str, cat: str, tid: int, start_ns: int, end_ns: int, t0: int,
          args: dict[str, Any], cname: str | None = None) -> dict[str, Any]:
    event = {
        "name": name, "cat": cat, "ph": "X", "pid": PID, "tid": tid,
        "ts": round((start_ns - t0) / 1000, 3), "dur": round(max(end_ns - start_ns, 0) / 1000, 3),
        "args": args,
    }
    if cname:
        event["cname"] = cname
    return event


def _ms(ns: Any) -> float | None:
    return None if ns is None else ns / 1e6


def _origin(trace: Trace) -> int:
    starts = [trace.steps["start_ns"].min()]
    for col in ("issued_ns", "started_ns", "finished_ns"):
        starts.append(trace.loads[col].min())
    starts = [s for s in starts if s is not None]
    return int(min(starts)) if starts else 0


def _load_name(row: dict[str, Any]) -> str:
    if row["expert"] == WHOLE_LAYER_EXPERT:
        return f"L{row['layer']} whole layer"
    return f"L{row['layer']} E{row['expert']}"


def _load_args(row: dict[str, Any]) -> dict[str, Any]:
    issued, started = row["issued_ns"], row["started_ns"]
    return {
        "step": row["step"], "layer": row["layer"], "expert": row["expert"],
        "bytes": row["bytes"], "offset": row["offset"], "source": row["source"],
        "cold": row["cold"], "waited": row["waited"], "wait_ms": _ms(row["wait_ns"]),
        "queue_ms": _ms(started - issued) if issued is not None and started is not None
        else None,
    }


def _main_track(trace: Trace, t0: int) -> tuple[list[dict[str, Any]], int]:
    """Step, build, eval and wait spans on the main track; returns (events, waits dropped)."""
    steps = trace.steps.filter(pl.col("start_ns").is_not_null() & pl.col("end_ns").is_not_null())
    steps = steps.sort("start_ns")
    waits = (
        trace.loads.filter(
            pl.col("waited").fill_null(False) & (pl.col("wait_ns").fill_null(0) > 0)
            & pl.col("finished_ns").is_not_null()
        )
        .with_columns((pl.col("finished_ns") - pl.col("wait_ns")).alias("wait_start"))
        .sort("wait_start")
    )
    # Assign each wait to the step whose interval holds its end (else its start).
    starts = steps["start_ns"].to_numpy()
    ends = steps["end_ns"].to_numpy()

    def step_of(t: int) -> int | None:
        i = int(np.searchsorted(starts, t, side="right")) - 1
        return i if i >= 0 and t <= ends[i] else None

    per_step: dict[int, list[dict[str, Any]]] = {}
    dropped = 0
    for w in waits.iter_rows(named=True):
        i = step_of(w["finished_ns"])
        if i is None:
            i = step_of(w["wait_start"])
        if i is None:
            dropped += 1
            continue
        per_step.setdefault(i, []).append(w)

    events: list[dict[str, Any]] = []
    prev_end = None
    for i, s in enumerate(steps.iter_rows(named=True)):
        # Overlapping steps (async pipelining) would break nesting: start at the previous end.
        start, end = s["start_ns"], s["end_ns"]
        if prev_end is not None:
            start = min(max(start, prev_end), end)
        prev_end = end if prev_end is None else max(prev_end, end)
        build, evaln, blocked = (s["build_ns"] or 0), (s["eval_ns"] or 0), (s["blocked_ns"] or 0)
        events.append(_span(
            f"{s['phase']} step {s['step']}", "step", MAIN_TID, start, end, t0,
            {"step": s["step"], "request": s["request"], "phase": s["phase"],
             "tokens": s["tokens"], "loads": s["loads"], "cold_loads": s["cold_loads"],
             "mib_read": None if s["bytes_read"] is None else s["bytes_read"] / MIB},
        ))
        # Serialise this step's waits: clip to the step and to the previous wait's end.
        clipped: list[tuple[int, int, dict[str, Any]]] = []
        last_end = start
        for w in per_step.get(i, []):
            a = max(w["wait_start"], last_end)
            b = min(w["finished_ns"], end)
            if b > a:
                clipped.append((a, b, w))
                last_end = b
            else:
                dropped += 1
        eval_start = max(start + build, end - evaln - blocked)
        if clipped:
            eval_start = min(eval_start, clipped[0][0])
        build_end = min(start + build, eval_start)
        if build_end > start:
            events.append(_span("build", "build", MAIN_TID, start, build_end, t0,
                                {"build_ms": build / 1e6}))
        if end > eval_start and (evaln or blocked or clipped):
            events.append(_span("eval", "eval", MAIN_TID, eval_start, end, t0,
                                {"eval_ms": evaln / 1e6, "blocked_ms": blocked / 1e6}))
        for a, b, w in clipped:
            events.append(_span(f"wait {_load_name(w)}", "wait", MAIN_TID, a, b, t0,
                                _load_args(w), cname="bad" if w["cold"] else "good"))
    return events, dropped


def _lanes(spans: list[tuple[int, int]]) -> list[int]:
    """Greedy lane per span (sorted by start) so spans within a lane never overlap."""
    lane_end: list[int] = []
    out = []
    for a, b in spans:
        for lane, last in enumerate(lane_end):
            if a >= last:
                lane_end[lane] = b
                out.append(lane)
                break
        else:
            lane_end.append(b)
            out.append(len(lane_end) - 1)
    return out


def _reader_tracks(trace: Trace, t0: int) -> tuple[list[dict[str, Any]], dict[int, str]]:
    loads = trace.loads.with_columns(
        pl.coalesce("started_ns", "issued_ns").alias("span_start"),
        pl.col("thread").fill_null("reader"),
    ).filter(pl.col("span_start").is_not_null() & pl.col("finished_ns").is_not_null())
    events: list[dict[str, Any]] = []
    names: dict[int, str] = {}
    next_tid = MAIN_READS_TID + 1
    threads = sorted(loads["thread"].unique().to_list(), key=_natural_key)
    for thread in threads:
        rows = list(loads.filter(pl.col("thread") == thread).sort("span_start")
                    .iter_rows(named=True))
        lanes = _lanes([(r["span_start"], r["finished_ns"]) for r in rows])
        tids: dict[int, int] = {}
        for lane in sorted(set(lanes)):
            if thread == "main" and lane == 0:
                tids[lane] = MAIN_READS_TID
            else:
                tids[lane] = next_tid
                next_tid += 1
            base = "main: reads" if thread == "main" else thread
            names[tids[lane]] = base if lane == 0 else f"{base} [{lane + 1}]"
        for row, lane in zip(rows, lanes, strict=True):
            cname = None if row["cold"] is None else ("bad" if row["cold"] else "good")
            events.append(_span(_load_name(row), "load", tids[lane], row["span_start"],
                                row["finished_ns"], t0, _load_args(row), cname=cname))
    return events, names


def chrome_trace(trace: Trace) -> dict[str, Any]:
    """The whole Chrome trace as a JSON-ready dict {"traceEvents": [...], ...}."""
    t0 = _origin(trace)
    main_events, dropped = _main_track(trace, t0)
    load_events, names = _reader_tracks(trace, t0)
    names = {MAIN_TID: "main", **names}
    model = (trace.run.get("model") or {}).get("name", "")
    meta: list[dict[str, Any]] = [{
        "name": "process_name", "ph": "M", "pid": PID, "tid": MAIN_TID,
        "args": {"name": f"ssdmoe {trace.kind} trace {model}".rstrip()},
    }]
    for tid, name in sorted(names.items()):
        meta.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid,
                     "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                     "args": {"sort_index": tid}})
    return {
        "traceEvents": meta + main_events + load_events,
        "displayTimeUnit": "ms",
        "otherData": {
            "trace": str(trace.path), "kind": trace.kind, "complete": trace.complete,
            "schema_version": trace.run.get("schema_version"), "waits_dropped": dropped,
        },
    }


def write_chrome(trace: Trace, out: str | Path) -> int:
    """Write the Chrome trace JSON atomically; returns the number of events."""
    data = chrome_trace(trace)
    out = Path(out)
    write_atomic(out, lambda tmp: tmp.write_text(json.dumps(data, separators=(",", ":"))))
    return len(data["traceEvents"])
