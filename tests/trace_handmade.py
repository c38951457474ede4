"""A small hand-made trace whose summary and timeline are worked out by hand in the tests.

2 layers x 4 experts, K=2. Times in ms below, stored as ns.
request 0: step 0 prefill (6 tokens, 0-3 ms), decode steps 1, 2, 3
request 1: step 4 prefill (4 tokens, 63-65 ms), decode steps 5, 6
"""

from __future__ import annotations

from pathlib import Path

from traces.run_info import RunInfo
from traces.writer import TraceWriter

MS = 1_000_000
MIB = 1 << 20

# step, request, phase, tokens, start, end, build, eval, blocked (ms), loads, cold, bytes (MiB),
# mlx_active, mlx_peak, rss
STEPS = [
    (0, 0, "prefill", 6, 0, 3, 0.5, 1.5, 1, 2, 2, 8, 600, 1000, 5000),
    (1, 0, "decode", 1, 3, 13, 3, 5, 2, 2, 1, 2, 800, -1, 6000),
    (2, 0, "decode", 1, 13, 33, 6, 10, 4, 3, 3, 3.5, 500, 700, -1),
    (3, 0, "decode", 1, 33, 63, 10, 20, 0, 0, 0, 0, 500, 600, 6500),
    (4, 1, "prefill", 4, 63, 65, 1, 1, 0, 0, 0, 0, 500, 900, 7000),
    (5, 1, "decode", 1, 65, 105, 10, 24, 6, 4, 2, 4, 500, 800, 6800),
    (6, 1, "decode", 1, 105, 155, 20, 22, 8, 1, 0, 1, 500, 800, None),
]

# Decode routing per layer in step order; prefill routing rows are added too (3 tokens) and
# must not count.
DECODE_ROUTING = {
    0: {1: [0, 1], 2: [1, 2], 3: [2, 1], 5: [3, 0], 6: [0, 3]},
    1: {1: [2, 3], 2: [0, 1], 3: [0, 1], 5: [1, 3], 6: [3, 1]},
}
PREFILL_ROUTING = {0: [[0, 1], [2, 3], [0, 2]], 4: [[3, 2], [1, 0], [2, 1]]}

# step, layer, expert, MiB, issued, started, finished (ms), source, cold, wait (ms or 0), thread
LOADS = [
    (0, 0, -1, 4, 0, 0, 2, "whole_layer", True, 1, "reader-0"),
    (0, 1, -1, 4, 0, 0.5, 2.5, "whole_layer", True, 0, "reader-1"),
    (1, 0, 0, 1, 3, 3, 9, "demand", True, 2, "reader-0"),
    (1, 1, 2, 1, 3, 3.5, 4, "demand", False, 0, "reader-1"),
    (2, 0, 2, 1, 13, 13, 15, "demand", True, 0, "reader-0"),
    (2, 1, 0, 1, 14, 14, 22, "demand", True, 4, "reader-1"),
    (2, 1, 1, 1.5, 14, 14, 20, "demand", True, 0, "reader-0"),  # overlaps the one above
    (5, 0, 3, 1, 65, 65, 82, "prefetch", True, 6, "reader-0"),
    (5, 0, 0, 1, 66, 66, 67, "prefetch", False, 0, "reader-1"),
    (5, 1, 1, 1, 67, 67, 75, "prefetch", True, 0, "reader-1"),
    (5, 1, 3, 1, 90, 90, 90.5, "demand", False, 0, "main"),
    (6, 1, 1, 1, 120, 120, 140, "demand", False, 8, "reader-0"),
]


def ns(ms: float) -> int:
    return int(round(ms * MS))


def step_rows() -> list[dict]:
    rows = []
    for (step, req, phase, tokens, start, end, build, evl, blocked, loads, cold, mib,
         active, peak, rss) in STEPS:
        rows.append({
            "step": step, "request": req, "phase": phase, "tokens": tokens,
            "start_ns": ns(start), "end_ns": ns(end), "build_ns": ns(build),
            "eval_ns": ns(evl), "blocked_ns": ns(blocked), "bytes_read": int(mib * MIB),
            "loads": loads, "cold_loads": cold, "cache_hits": 0, "cache_misses": 0,
            "cache_evictions": 0, "mlx_active_bytes": active, "mlx_peak_bytes": peak,
            "rss_bytes": rss, "page_cache_bytes": -1,
        })
    return rows


def routing_rows() -> list[dict]:
    rows = []
    for step, sets in PREFILL_ROUTING.items():
        for layer in (0, 1):
            for token, experts in enumerate(sets):
                rows.append({"step": step, "layer": layer, "token": token, "experts": experts,
                             "weights": [0.5, 0.5], "source": "router"})
    for layer, per_step in DECODE_ROUTING.items():
        for step, experts in per_step.items():
            rows.append({"step": step, "layer": layer, "token": 0, "experts": experts,
                         "weights": [0.7, 0.3], "source": "router"})
    return rows


def load_rows() -> list[dict]:
    rows = []
    for (step, layer, expert, mib, issued, started, finished, source, cold, wait,
         thread) in LOADS:
        rows.append({
            "step": step, "layer": layer, "expert": expert, "bytes": int(mib * MIB),
            "offset": 0, "issued_ns": ns(issued), "started_ns": ns(started),
            "finished_ns": ns(finished), "source": source, "cold": cold,
            "waited": wait > 0, "wait_ns": ns(wait), "thread": thread,
        })
    return rows


def run_info(kind: str = "measured") -> RunInfo:
    model = {"name": "handmade", "architecture": "test", "layers": 2, "experts": 4, "k": 2,
             "bundle_bytes": MIB}
    return RunInfo(model=model, engine={"paths": "test"}, kind=kind)


def write_handmade(directory: Path, kind: str = "measured") -> Path:
    with TraceWriter(directory, run_info(kind), flush_every=4) as writer:
        for row in step_rows():
            writer.add_step(row)
        for row in routing_rows():
            writer.add_routing(row)
        for row in load_rows():
            writer.add_load(row)
    return directory


def table_file(trace_dir: Path, table: str) -> Path:
    """The one part file of a closed trace's table (close() merges the parts)."""
    from traces.schema import live_parts

    parts = live_parts([p.name for p in (trace_dir / table).iterdir()])
    assert len(parts) == 1, parts
    return trace_dir / table / parts[0]
