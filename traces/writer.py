"""TraceWriter: buffers rows (cheap appends on the hot path) and flushes every `flush_every`
steps by writing the rows added since the last flush as one new part per table (traces.schema:
a table is a directory of parquet parts), under a temporary name renamed into place, so a crash
or Ctrl-C leaves a trace that opens with everything up to the last flush. A flush costs what is
new, not what the trace holds. `close()` merges each table's parts into one.

`min_interval_s` and `max_flush_fraction` bound the time spent flushing: a flush that is due by
step count waits until at least max(min_interval_s, last flush cost / max_flush_fraction) has
passed since the previous one ended (defaults 0 / None: flush strictly every `flush_every`
steps). Steps added with `hold=True` (the recorder's) are flushed at `flush_if_due`, between
requests, and inside one only past `max_held_steps`: a crash then loses the request in
progress."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from traces.run_info import RunInfo
from traces.schema import (
    LOADS,
    ROUTING,
    RUN_FILE,
    STEPS,
    TABLES,
    live_parts,
    parse_part,
    part_name,
)


def write_atomic(path: Path, write: Any, durable: bool = True) -> None:
    """Call write(tmp_path), fsync it when `durable`, then rename over `path` (atomic on POSIX).
    Without fsync the rename still protects against a killed process (the data is in the page
    cache), not against a machine crash."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file left beside the trace
        raise
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict[str, Any], durable: bool = True) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, default=str) + "\n"),
                 durable)


_NUMPY = {pl.Int16(): np.int16, pl.Int32(): np.int32, pl.Int64(): np.int64,
          pl.Float32(): np.float32, pl.Float64(): np.float64}


def _series(name: str, values: list[Any], dtype: pl.DataType) -> pl.Series:
    """A column from Python values. Lists of equal-length lists (routing's experts/weights) go
    through one 2-D NumPy array: polars converts nested Python lists row by row (~40 us each)."""
    inner = getattr(dtype, "inner", None) if isinstance(dtype, pl.List) else None
    if values and inner in _NUMPY and values[0] is not None:
        try:
            arr = np.array(values, dtype=_NUMPY[inner])
        except (ValueError, TypeError):  # ragged, or holds None
            arr = None
        if arr is not None and arr.ndim == 2 and arr.shape[1] > 0:
            return pl.Series(name, arr).cast(dtype)
    return pl.Series(name, values, dtype=dtype, strict=False)


class _Table:
    """Rows kept as they come (dicts from `add`, by reference: do not mutate a row after adding
    it; column lists from `extend`) and frozen into one DataFrame per flush, where polars
    converts them in bulk. `take()` hands over what is not on disk yet, and the rows stay taken
    until `written()`: a flush that fails writes them again next time. Row order within one
    flush is not significant."""

    def __init__(self, directory: Path, columns: dict[str, pl.DataType]) -> None:
        self.dir = directory
        self.columns = columns
        self.rows: list[dict[str, Any]] = []
        self.pending: dict[str, list[Any]] = {name: [] for name in columns}
        self.unwritten: list[pl.DataFrame] = []
        self.next_part = 0

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)  # ~0.05 us; the per-column split happens at flush time

    def extend(self, columns: dict[str, list[Any]], n: int) -> None:
        """Append n rows given column-wise; a column absent from `columns` gets nulls."""
        for name in self.columns:  # check all first: a bad call must not half-append
            values = columns.get(name)
            if values is not None and len(values) != n:
                raise ValueError(f"column {name}: {len(values)} values for {n} rows")
        pending = self.pending
        for name in self.columns:
            values = columns.get(name)
            pending[name].extend([None] * n if values is None else values)

    def take(self) -> pl.DataFrame:
        """Every row not yet written, as one frame."""
        if self.rows:
            self.unwritten.append(pl.from_dicts(self.rows, schema=self.columns, strict=False))
            self.rows = []
        if self.pending[next(iter(self.columns))]:
            self.unwritten.append(pl.DataFrame(
                [_series(name, self.pending[name], dtype) for name, dtype in self.columns.items()]
            ))
            self.pending = {name: [] for name in self.columns}
        if not self.unwritten:
            return pl.DataFrame(schema=self.columns)
        if len(self.unwritten) > 1:
            self.unwritten = [pl.concat(self.unwritten, how="vertical")]
        return self.unwritten[0]

    def write_part(self, durable: bool, always: bool = False) -> None:
        """Write the untaken and taken rows as the next part (skipped when there are none,
        unless `always`)."""
        frame = self.take()
        if frame.height or always:
            write_atomic(self.dir / part_name(self.next_part), frame.write_parquet, durable)
            self.next_part += 1
        self.unwritten = []

    def merge_parts(self, durable: bool) -> None:
        """Replace the parts by one merged part (written first, then the parts removed: a
        reader skips single parts a merged one covers)."""
        names = live_parts([p.name for p in self.dir.iterdir()])
        if len(names) < 2:
            return
        ranges = [parse_part(n) for n in names]
        first, last = ranges[0][0], ranges[-1][1]
        frame = pl.concat([pl.read_parquet(self.dir / n) for n in names], how="vertical")
        write_atomic(self.dir / part_name(first, last), frame.write_parquet, durable)
        for n in names:
            (self.dir / n).unlink()


class TraceWriter:
    """`add_step(row, hold=True)` keeps the rows in memory (a step being measured is not the
    place for a flush: the recorder's first one took ~60 ms of a 5 ms decode step) until
    `flush_if_due` at a request boundary, or until `max_held_steps` are held."""

    def __init__(self, directory: str | Path, run: RunInfo, flush_every: int = 16,
                 min_interval_s: float = 0.0, max_flush_fraction: float | None = None,
                 max_held_steps: int = 4096) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = run
        self.flush_every = flush_every
        self.min_interval_s = min_interval_s
        self.max_flush_fraction = max_flush_fraction
        self.max_held_steps = max_held_steps
        self.flushes = 0
        self.flush_s = 0.0  # total time spent in flush()
        self._last_flush_cost = 0.0
        self._last_flush_end = 0.0
        tables = {}
        for name, columns in TABLES.items():
            (self.dir / name).mkdir(exist_ok=True)
            tables[name] = _Table(self.dir / name, columns)
        self.steps, self.routing, self.loads = tables[STEPS], tables[ROUTING], tables[LOADS]
        self._steps_since_flush = 0
        self.closed = False
        self.flush(always=True)  # an empty but valid trace exists from the start

    def add_step(self, row: dict[str, Any], hold: bool = False) -> None:
        # Flush when the NEXT step arrives, not right after this one: routing and load rows a
        # recorder adds after a step's row then land in the same flush as that step.
        limit = self.max_held_steps if hold else self.flush_every
        if self._steps_since_flush >= limit and self._due():
            self.flush()
        self.steps.add(row)
        self._steps_since_flush += 1

    def add_routing(self, row: dict[str, Any]) -> None:
        self.routing.add(row)

    def add_load(self, row: dict[str, Any]) -> None:
        self.loads.add(row)

    def add_routing_columns(self, columns: dict[str, list[Any]], n: int) -> None:
        """Add n routing rows given column-wise (cheaper than n dicts for wide prefills)."""
        self.routing.extend(columns, n)

    def flush_if_due(self) -> None:
        """At a boundary between requests, where no step is being timed: write the held rows
        once `flush_every` steps are held."""
        if self._steps_since_flush >= self.flush_every:
            self.flush()

    def _due(self) -> bool:
        if self.min_interval_s <= 0 and not self.max_flush_fraction:
            return True
        gap = self.min_interval_s
        if self.max_flush_fraction:
            gap = max(gap, self._last_flush_cost / self.max_flush_fraction)
        return time.perf_counter() - self._last_flush_end >= gap

    def flush(self, durable: bool = False, always: bool = False) -> None:
        """Write each table's new rows as a part, then run.json, each atomically. Periodic
        flushes skip fsync (they guard against a killed process, and fsync costs milliseconds
        per file); close() fsyncs. The steps table goes last: a flush cut short anywhere leaves
        every step in steps/ with its routing and load rows on disk (the other tables may hold
        rows of steps not yet in it, which a later flush completes: rows a failed write did not
        put on disk are written again)."""
        t0 = time.perf_counter()
        for table in (self.loads, self.routing, self.steps):
            table.write_part(durable, always)
        write_json_atomic(self.dir / RUN_FILE, self.run.to_dict(), durable)
        self._steps_since_flush = 0
        self._last_flush_end = time.perf_counter()
        self._last_flush_cost = self._last_flush_end - t0
        self.flush_s += self._last_flush_cost
        self.flushes += 1

    def close(self) -> None:
        if self.closed:
            return
        self.run.complete = True
        self.flush(durable=True)
        for table in (self.loads, self.routing, self.steps):
            table.merge_parts(durable=True)
        self.closed = True

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.flush()  # keep what was captured; run.json says complete=false


def write_tables(directory: Path, frames: dict[str, pl.DataFrame], run: dict[str, Any]) -> None:
    """A whole trace at once (a simulated run): each table as one part, steps last, then
    run.json."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in (LOADS, ROUTING, STEPS):
        (directory / name).mkdir(exist_ok=True)
        write_atomic(directory / name / part_name(0), frames[name].write_parquet)
    write_json_atomic(directory / RUN_FILE, run)
