"""What a trace flush costs over a long capture: 10,000 decode steps of a 40-layer, 256-expert,
K=8 model (the 35B's shape: edge0 digest), rows as the recorder writes them (a step row, one
routing row per layer, the step's expert loads), flushed every 32 steps (the recorder's
default). Two arms in one run, alternating block by block:

  parts    traces.writer.TraceWriter: each flush writes the rows added since the last
  rewrite  schema version 1, emulated: each flush rewrites every table whole

Prints flush cost per 1,000-step block (median ms) and writes reports/traces/flush_cost.json.

    uv run python reports/traces/flush_cost.py [--steps 10000] [--loads-per-step 96]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from traces.run_info import RunInfo  # noqa: E402
from traces.schema import TABLES  # noqa: E402
from traces.writer import TraceWriter, write_atomic  # noqa: E402

LAYERS, EXPERTS, K, FLUSH_EVERY = 40, 256, 8, 32


class RewriteWriter(TraceWriter):
    """Version 1's flush: every table rewritten whole (kept here only to compare)."""

    def flush(self, durable: bool = False, always: bool = False) -> None:
        t0 = time.perf_counter()
        for name, table in (("loads", self.loads), ("routing", self.routing),
                            ("steps", self.steps)):
            frame = table.take()  # everything added so far: take() keeps it until written
            write_atomic(self.dir / f"{name}.parquet", frame.write_parquet, durable)
        self._steps_since_flush = 0
        self._last_flush_end = time.perf_counter()
        self._last_flush_cost = self._last_flush_end - t0
        self.flush_s += self._last_flush_cost
        self.flushes += 1


def make_rows(step: int, loads: int, rng: random.Random) -> tuple[dict, dict, list[dict]]:
    """One decode step's rows: its step row, routing columns and load rows."""
    t = step * 50_000_000
    step_row = {"step": step, "request": 0, "phase": "decode", "tokens": 1, "start_ns": t,
                "end_ns": t + 49_000_000, "build_ns": 9_000_000, "eval_ns": 30_000_000,
                "blocked_ns": 10_000_000, "bytes_read": loads * 1_700_000, "loads": loads,
                "cold_loads": loads // 3, "cache_hits": LAYERS * K - loads,
                "cache_misses": loads, "cache_evictions": loads}
    experts = [rng.sample(range(EXPERTS), K) for _ in range(LAYERS)]
    routing = {"step": [step] * LAYERS, "layer": list(range(LAYERS)), "token": [0] * LAYERS,
               "experts": experts, "weights": [[1 / K] * K for _ in range(LAYERS)],
               "source": ["prediction"] * LAYERS, "router_experts": [None] * LAYERS}
    load_rows = [{"step": step, "layer": i % LAYERS, "expert": rng.randrange(EXPERTS),
                  "bytes": 1_700_000, "offset": 4096 * i, "issued_ns": t, "started_ns": t,
                  "finished_ns": t + 400_000, "source": "prefetch", "cold": i % 3 == 0,
                  "waited": False, "wait_ns": 0, "thread": "reader-0"} for i in range(loads)]
    return step_row, routing, load_rows


def add_step(w: TraceWriter, rows: tuple[dict, dict, list[dict]]) -> None:
    """What the recorder hands the writer per step (loads first, as engine.recorder does)."""
    step_row, routing, load_rows = rows
    for r in load_rows:
        w.add_load(r)
    w.add_step(step_row)
    w.add_routing_columns(routing, LAYERS)


def run(arm: str, steps: int, loads: int, workdir: Path) -> dict:
    cls = TraceWriter if arm == "parts" else RewriteWriter
    w = cls(workdir / arm, RunInfo(model={"name": "synthetic-35b-shape"}, engine={}),
            flush_every=FLUSH_EVERY)
    rng = random.Random(0)
    costs: list[tuple[int, float]] = []  # (step at which the flush ran, seconds)
    add_s = 0.0
    for step in range(steps):
        rows = make_rows(step, loads, rng)
        before, t0 = w.flushes, time.perf_counter()
        add_step(w, rows)
        dt = time.perf_counter() - t0
        if w.flushes > before:
            costs.append((step, w._last_flush_cost))
            dt -= w._last_flush_cost
        add_s += dt
    t0 = time.perf_counter()
    if arm == "parts":
        w.close()
    close_s = time.perf_counter() - t0
    return {"costs": costs, "add_ms_per_step": 1e3 * add_s / steps, "close_s": close_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--loads-per-step", type=int, default=96)
    ap.add_argument("--out", type=Path, default=ROOT / "reports/traces/flush_cost.json")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ("rewrite", "parts"):  # rewrite first: the slow arm does not warm the disk
            results[arm] = run(arm, args.steps, args.loads_per_step, Path(tmp))
        from traces.reader import read_trace

        t0 = time.perf_counter()
        trace = read_trace(Path(tmp) / "parts")
        read_s = time.perf_counter() - t0
        assert trace.steps.height == args.steps
        assert trace.routing.height == args.steps * LAYERS
    block = 1000
    rows = []
    for start in range(0, args.steps, block):
        row = {"steps": f"{start}-{start + block}"}
        for arm, r in results.items():
            c = [s for step, s in r["costs"] if start <= step < start + block]
            row[arm] = 1e3 * statistics.median(c) if c else None
        rows.append(row)
    first, last = rows[0], rows[-1]
    summary = {arm: {"first_block_ms": first[arm], "last_block_ms": last[arm],
                     "growth": last[arm] / first[arm],
                     "flush_ms_per_step": sum(s for _, s in r["costs"]) * 1e3 / args.steps,
                     "add_ms_per_step": r["add_ms_per_step"], "close_s": r["close_s"]}
               for arm, r in results.items()}
    print(f"flush cost (median ms per flush), {args.steps} decode steps x {LAYERS} layers, "
          f"K={K}, {args.loads_per_step} loads/step, a flush every {FLUSH_EVERY} steps")
    print(f"{'steps':>12} {'parts':>8} {'rewrite':>8}")
    for row in rows:
        print(f"{row['steps']:>12} {row['parts']:8.2f} {row['rewrite']:8.2f}")
    for arm, s in summary.items():
        print(f"{arm}: last/first block {s['growth']:.2f}x; flushing {s['flush_ms_per_step']:.3f}"
              f" ms/step, adding rows {s['add_ms_per_step']:.3f} ms/step")
    print(f"parts: close (merge) {summary['parts']['close_s']:.2f} s; read_trace {read_s:.2f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "uv run python reports/traces/flush_cost.py " + " ".join(sys.argv[1:]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "shape": {"steps": args.steps, "layers": LAYERS, "experts": EXPERTS, "k": K,
                  "loads_per_step": args.loads_per_step, "flush_every": FLUSH_EVERY},
        "blocks": rows, "summary": summary, "read_trace_s": read_s,
        "polars": pl.__version__, "tables": list(TABLES)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
