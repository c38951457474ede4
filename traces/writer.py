"""TraceWriter: buffers rows column-wise (cheap appends on the hot path) and flushes every
`flush_every` steps by rewriting each table under a temporary name and renaming it, so a
crash or Ctrl-C leaves a trace that opens with everything up to the last flush."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import polars as pl

from traces.run_info import RunInfo
from traces.schema import (
    LOAD_COLUMNS,
    LOADS_FILE,
    ROUTING_COLUMNS,
    ROUTING_FILE,
    RUN_FILE,
    STEP_COLUMNS,
    STEPS_FILE,
)


def write_atomic(path: Path, write: Any) -> None:
    """Call write(tmp_path), fsync it, then rename over `path` (atomic on POSIX)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, default=str) + "\n"))


class _Table:
    """Rows kept as per-column Python lists; frozen into DataFrame chunks at each flush."""

    def __init__(self, columns: dict[str, pl.DataType]) -> None:
        self.columns = columns
        self.pending: dict[str, list[Any]] = {name: [] for name in columns}
        self.chunks: list[pl.DataFrame] = []

    def add(self, row: dict[str, Any]) -> None:
        pending = self.pending
        for name in self.columns:
            pending[name].append(row.get(name))

    def frame(self) -> pl.DataFrame:
        if self.pending[next(iter(self.columns))]:
            self.chunks.append(pl.DataFrame(self.pending, schema=self.columns, strict=False))
            self.pending = {name: [] for name in self.columns}
        if not self.chunks:
            return pl.DataFrame(schema=self.columns)
        if len(self.chunks) > 1:
            self.chunks = [pl.concat(self.chunks, how="vertical")]
        return self.chunks[0]


class TraceWriter:
    def __init__(self, directory: str | Path, run: RunInfo, flush_every: int = 16) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = run
        self.flush_every = flush_every
        self.steps = _Table(STEP_COLUMNS)
        self.routing = _Table(ROUTING_COLUMNS)
        self.loads = _Table(LOAD_COLUMNS)
        self._steps_since_flush = 0
        self.closed = False
        self.flush()  # an empty but valid trace exists from the start

    def add_step(self, row: dict[str, Any]) -> None:
        # Flush when the NEXT step arrives, not right after this one: routing and load rows a
        # recorder adds after a step's row then land in the same flush as that step.
        if self._steps_since_flush >= self.flush_every:
            self.flush()
        self.steps.add(row)
        self._steps_since_flush += 1

    def add_routing(self, row: dict[str, Any]) -> None:
        self.routing.add(row)

    def add_load(self, row: dict[str, Any]) -> None:
        self.loads.add(row)

    def flush(self) -> None:
        for name, table in ((STEPS_FILE, self.steps), (ROUTING_FILE, self.routing),
                            (LOADS_FILE, self.loads)):
            frame = table.frame()
            write_atomic(self.dir / name, frame.write_parquet)
        write_json_atomic(self.dir / RUN_FILE, self.run.to_dict())
        self._steps_since_flush = 0

    def close(self) -> None:
        if self.closed:
            return
        self.run.complete = True
        self.flush()
        self.closed = True

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.flush()  # keep what was captured; run.json says complete=false
