"""Open a trace directory. Every failure is a one-line BadInput naming the file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from contract.errors import BadInput, read_json_object
from traces.schema import (
    LATER_COLUMNS,
    RUN_FILE,
    SCHEMA_VERSION,
    TABLES,
    V1_FILES,
    live_parts,
)


@dataclass
class Trace:
    path: Path
    run: dict[str, Any]
    steps: pl.DataFrame
    routing: pl.DataFrame
    loads: pl.DataFrame

    @property
    def complete(self) -> bool:
        return bool(self.run.get("complete", False))

    @property
    def kind(self) -> str:
        return str(self.run.get("kind", "measured"))


def read_run(directory: Path) -> dict[str, Any]:
    path = directory / RUN_FILE
    if not directory.is_dir():
        raise BadInput(f"{directory}: trace directory does not exist")
    run = read_json_object(path, "missing (not a trace directory?)")
    version = run.get("schema_version")
    if not isinstance(version, int):
        raise BadInput(f"{path}: no schema_version")
    if version > SCHEMA_VERSION:
        raise BadInput(
            f"{path}: schema_version {version} is newer than this ssdmoe reads ({SCHEMA_VERSION});"
            " upgrade ssdmoe"
        )
    return run


def read_table(path: Path, columns: dict[str, pl.DataType]) -> pl.DataFrame:
    """One parquet file, or a table directory of parts joined in order (traces.schema)."""
    if path.is_dir():
        parts = live_parts([p.name for p in path.iterdir()])
        if not parts:
            raise BadInput(f"{path}: no parts (missing)")
        frames = [read_table(path / name, columns) for name in parts]
        try:
            return pl.concat([f.select(list(columns)) for f in frames], how="vertical_relaxed")
        except Exception as err:  # noqa: BLE001 - parts whose column types disagree
            raise BadInput(f"{path}: parts do not agree ({str(err).splitlines()[0]})") from None
    if not path.is_file():
        raise BadInput(f"{path}: missing")
    try:
        frame = pl.read_parquet(path)
    except Exception as err:  # polars raises several error types for corrupt files
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise BadInput(f"{path}: unreadable parquet ({reason})") from None
    later = [name for name in LATER_COLUMNS if name in columns and name not in frame.columns]
    if later:
        frame = frame.with_columns(pl.lit(LATER_COLUMNS[n], dtype=columns[n]).alias(n)
                                   for n in later)
    missing = [name for name in columns if name not in frame.columns]
    if missing:
        raise BadInput(f"{path}: missing columns {', '.join(missing)}")
    return frame


def read_trace(directory: str | Path) -> Trace:
    """A trace of schema version 2 (table directories of parts) or 1 (one file per table)."""
    directory = Path(directory)
    run = read_run(directory)
    v1 = int(run["schema_version"]) < 2
    frames = {name: read_table(directory / (V1_FILES[name] if v1 else name), cols)
              for name, cols in TABLES.items()}
    return Trace(directory, run, *frames.values())
