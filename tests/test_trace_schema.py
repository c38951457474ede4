"""TraceWriter / read_trace: atomic periodic flush, half-written traces, bad input."""

from __future__ import annotations

import json

import polars as pl
import pytest
from trace_handmade import (
    load_rows,
    routing_rows,
    run_info,
    step_rows,
    table_file,
    write_handmade,
)

from contract.errors import BadInput
from traces.reader import read_trace
from traces.run_info import RunInfo
from traces.schema import (
    LOAD_COLUMNS,
    LOADS,
    ROUTING,
    ROUTING_COLUMNS,
    RUN_FILE,
    SCHEMA_VERSION,
    STEP_COLUMNS,
    STEPS,
)
from traces.writer import TraceWriter


def _write_steps(writer: TraceWriter, n: int) -> None:
    """Like a recorder: a step's routing and load rows are added after its step row."""
    for s in range(n):
        writer.add_step({"step": s, "request": 0, "phase": "decode", "tokens": 1,
                         "start_ns": 10 * s, "end_ns": 10 * s + 5})
        writer.add_routing({"step": s, "layer": 0, "token": 0, "experts": [s % 4, 4],
                            "weights": [0.5, 0.5], "source": "router"})
        writer.add_load({"step": s, "layer": 0, "expert": s % 4, "bytes": 100,
                         "thread": "reader-0"})


def test_round_trip_keeps_rows_and_types(tmp_path):
    trace = read_trace(write_handmade(tmp_path / "t"))
    assert trace.complete and trace.kind == "measured"
    assert trace.run["schema_version"] == SCHEMA_VERSION
    assert trace.run["model"]["experts"] == 4
    assert dict(trace.steps.schema) == STEP_COLUMNS
    assert dict(trace.routing.schema) == ROUTING_COLUMNS
    assert dict(trace.loads.schema) == LOAD_COLUMNS
    assert trace.steps.height == len(step_rows())
    assert trace.routing.height == len(routing_rows())
    assert trace.loads.height == len(load_rows())
    assert trace.routing.filter(pl.col("step") == 3, pl.col("layer") == 0)["experts"].to_list() \
        == [[2, 1]]
    assert trace.steps["rss_bytes"].to_list()[-1] is None


def test_killed_run_opens_with_what_was_flushed(tmp_path):
    writer = TraceWriter(tmp_path / "t", run_info(), flush_every=2)
    _write_steps(writer, 5)
    # No close(): as if the process were killed here. Flushes happened as steps 2 and 4
    # began, so steps 0-3 are on disk, each with its routing and load rows.
    trace = read_trace(tmp_path / "t")
    assert not trace.complete
    assert trace.steps["step"].to_list() == [0, 1, 2, 3]
    assert trace.routing["step"].to_list() == [0, 1, 2, 3]
    assert trace.loads["step"].to_list() == [0, 1, 2, 3]
    assert not list(tmp_path.glob("t/**/.*.tmp"))  # no temporary files left behind
    writer.close()
    trace = read_trace(tmp_path / "t")
    assert trace.complete and trace.steps.height == 5 and trace.routing.height == 5


def test_fresh_writer_is_an_empty_valid_trace(tmp_path):
    TraceWriter(tmp_path / "t", run_info())
    trace = read_trace(tmp_path / "t")
    assert not trace.complete
    assert trace.steps.height == trace.routing.height == trace.loads.height == 0


def test_exception_inside_with_keeps_rows_and_stays_incomplete(tmp_path):
    with pytest.raises(KeyboardInterrupt), TraceWriter(tmp_path / "t", run_info(),
                                                       flush_every=100) as writer:
        _write_steps(writer, 3)
        raise KeyboardInterrupt
    trace = read_trace(tmp_path / "t")
    assert not trace.complete and trace.steps.height == 3


def _one_line(err: BadInput, name: str) -> None:
    message = str(err)
    assert "\n" not in message and name in message


def test_newer_schema_version_is_bad_input(tmp_path):
    path = write_handmade(tmp_path / "t")
    run = json.loads((path / RUN_FILE).read_text())
    run["schema_version"] = SCHEMA_VERSION + 1
    (path / RUN_FILE).write_text(json.dumps(run))
    with pytest.raises(BadInput, match="newer") as err:
        read_trace(path)
    _one_line(err.value, RUN_FILE)


@pytest.mark.parametrize("name", [STEPS, ROUTING, LOADS])
def test_truncated_parquet_is_bad_input_naming_the_file(tmp_path, name):
    path = write_handmade(tmp_path / "t")
    part = table_file(path, name)
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInput, match="unreadable parquet") as err:
        read_trace(path)
    _one_line(err.value, str(part))


@pytest.mark.parametrize("name", [RUN_FILE, STEPS, LOADS])
def test_missing_file_is_bad_input(tmp_path, name):
    path = write_handmade(tmp_path / "t")
    if name == RUN_FILE:
        (path / name).unlink()
    else:
        table_file(path, name).unlink()
    with pytest.raises(BadInput, match="missing") as err:
        read_trace(path)
    _one_line(err.value, str(path / name))


def test_missing_directory_and_bad_json_and_missing_column(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        read_trace(tmp_path / "nope")
    path = write_handmade(tmp_path / "t")
    part = table_file(path, STEPS)
    pl.read_parquet(part).drop("blocked_ns").write_parquet(part)
    with pytest.raises(BadInput, match="missing columns blocked_ns"):
        read_trace(path)
    (path / RUN_FILE).write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON") as err:
        read_trace(path)
    _one_line(err.value, RUN_FILE)


@pytest.mark.parametrize("failing", [LOADS, ROUTING, STEPS, "run.json"])
def test_flush_cut_short_leaves_a_consistent_trace(tmp_path, monkeypatch, failing):
    """A failure injected inside a flush, while one part is half written: every table still
    opens, each step in steps/ has its routing and load rows on disk, and no half-written file
    is left beside the trace. The next flush writes what the failed one did not, once."""
    import traces.writer as writer_mod

    d = tmp_path / "t"
    w = TraceWriter(d, RunInfo(model={"name": "m"}, engine={}), flush_every=100)

    def add(step: int) -> None:
        w.add_step({"step": step, "request": 0, "phase": "decode", "tokens": 1,
                    "start_ns": step, "end_ns": step + 1})
        w.add_routing({"step": step, "layer": 0, "token": 0, "experts": [step % 4, 5],
                       "weights": [0.5, 0.5], "source": "router"})
        w.add_load({"step": step, "layer": 0, "expert": 5, "bytes": 10, "issued_ns": step,
                    "started_ns": step, "finished_ns": step + 1, "source": "demand",
                    "cold": False, "waited": True, "wait_ns": 1, "thread": "main"})

    for step in range(4):
        add(step)
    w.flush()  # steps 0-3 on disk
    real = writer_mod.write_atomic

    def broken(path, write, durable=True):
        if failing in (path.name, path.parent.name):
            def half(tmp):
                tmp.write_bytes(b"PAR1 half a file")
                raise OSError(28, "No space left on device")
            return real(path, half, durable)
        return real(path, write, durable)

    monkeypatch.setattr(writer_mod, "write_atomic", broken)
    for step in range(4, 7):
        add(step)
    with pytest.raises(OSError, match="No space"):
        w.flush()
    t = read_trace(d)  # every table opens
    steps = set(t.steps["step"].to_list())
    assert steps in ({0, 1, 2, 3}, set(range(7)))
    assert steps <= set(t.routing["step"].to_list())
    assert steps <= set(t.loads["step"].to_list())
    assert not [p.name for p in d.rglob(".*")], "half-written file left"
    monkeypatch.setattr(writer_mod, "write_atomic", real)
    add(7)
    w.close()
    t = read_trace(d)
    for table in (t.steps, t.routing, t.loads):  # every row once, none lost
        assert sorted(table["step"].to_list()) == list(range(8))


def test_parts_hold_only_new_rows_and_merge_at_close(tmp_path, monkeypatch):
    """Each flush writes one part per table with the rows added since the last (O(new rows)),
    close() merges them, and a close killed between the merged part and the removal of the
    parts it covers reads every row once."""
    import traces.writer as writer_mod

    d = tmp_path / "t"
    w = TraceWriter(d, run_info(), flush_every=2)
    _write_steps(w, 7)  # flushes as steps 2, 4, 6 begin
    parts = sorted(p.name for p in (d / STEPS).iterdir())
    assert parts == ["000000.parquet", "000001.parquet", "000002.parquet", "000003.parquet"]
    assert [pl.read_parquet(d / STEPS / n)["step"].to_list() for n in parts] == \
        [[], [0, 1], [2, 3], [4, 5]]
    real_unlink = writer_mod.Path.unlink
    calls = []

    def dies(self, *a, **k):  # the process dies after removing one covered part
        calls.append(self)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(writer_mod.Path, "unlink", dies)
    with pytest.raises(KeyboardInterrupt):
        w.close()
    monkeypatch.undo()
    names = sorted(p.name for p in (d / LOADS).iterdir())
    assert "000000-000004.parquet" in names and len(names) > 1  # merged, parts still there
    t = read_trace(d)
    for table in (t.steps, t.routing, t.loads):
        assert sorted(table["step"].to_list()) == list(range(7))


def test_schema_version_1_traces_still_read(tmp_path):
    """A version-1 trace (one parquet file per table) reads as it did."""
    from traces.schema import V1_FILES

    new = read_trace(write_handmade(tmp_path / "v2"))
    old = tmp_path / "v1"
    old.mkdir()
    for name, frame in ((STEPS, new.steps), (ROUTING, new.routing), (LOADS, new.loads)):
        frame.write_parquet(old / V1_FILES[name])
    (old / RUN_FILE).write_text(json.dumps({**new.run, "schema_version": 1}))
    back = read_trace(old)
    assert back.steps.equals(new.steps) and back.loads.equals(new.loads)
    assert back.routing.equals(new.routing)
