"""Chrome trace export of the hand-made trace: valid JSON, the tracks and events worked out by
hand, spans that nest on every track."""

from __future__ import annotations

import json
from collections import Counter

import polars as pl
import pytest
from trace_handmade import write_handmade

from traces.chrome import chrome_trace, write_chrome
from traces.reader import Trace, read_trace


@pytest.fixture
def chrome(tmp_path) -> dict:
    trace = read_trace(write_handmade(tmp_path / "t", kind="simulated"))
    out = tmp_path / "out.json"
    n = write_chrome(trace, out)
    data = json.loads(out.read_text())
    assert n == len(data["traceEvents"])
    return data


def _spans(data: dict, **match) -> list[dict]:
    return [e for e in data["traceEvents"] if e["ph"] == "X"
            and all(e.get(k) == v for k, v in match.items())]


def test_tracks_and_process_name(chrome):
    meta = [e for e in chrome["traceEvents"] if e["ph"] == "M"]
    names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert names == {0: "main", 1: "main: reads", 2: "reader-0", 3: "reader-0 [2]",
                     4: "reader-1"}
    process = [e for e in meta if e["name"] == "process_name"]
    assert len(process) == 1 and "simulated" in process[0]["args"]["name"]
    assert len(meta) == 1 + 2 * 5  # process name + name and sort index per track


def test_event_counts(chrome):
    cats = Counter(e["cat"] for e in _spans(chrome))
    # 7 steps each with build and eval; 5 loads the main thread waited on; 12 loads
    assert cats == {"step": 7, "build": 7, "eval": 7, "wait": 5, "load": 12}
    loads = _spans(chrome, cat="load")
    assert Counter(e["cname"] for e in loads) == {"bad": 8, "good": 4}
    per_track = Counter(e["tid"] for e in loads)
    assert per_track == {1: 1, 2: 5, 3: 1, 4: 5}
    assert {e["name"] for e in loads if e["args"]["expert"] == -1} == {
        "L0 whole layer", "L1 whole layer"}


def test_span_positions(chrome):
    steps = {e["args"]["step"]: e for e in _spans(chrome, cat="step")}
    assert (steps[2]["ts"], steps[2]["dur"]) == (13_000, 20_000)  # microseconds
    assert steps[2]["name"] == "decode step 2"
    evals = sorted(_spans(chrome, cat="eval"), key=lambda e: e["ts"])
    builds = sorted(_spans(chrome, cat="build"), key=lambda e: e["ts"])
    # step 1: build 3 ms at the start, eval + blocked = 7 ms at the end of 3..13 ms
    assert (builds[1]["ts"], builds[1]["dur"]) == (3_000, 3_000)
    assert (evals[1]["ts"], evals[1]["dur"]) == (6_000, 7_000)
    # step 2: eval would start at 19 ms but a wait starts at 18 ms: eval stretches back to 18
    assert (evals[2]["ts"], evals[2]["dur"]) == (18_000, 15_000)
    assert (builds[2]["ts"], builds[2]["dur"]) == (13_000, 5_000)
    assert evals[2]["args"] == {"eval_ms": 10.0, "blocked_ms": 4.0}
    waits = sorted(_spans(chrome, cat="wait"), key=lambda e: e["ts"])
    assert [(w["ts"], w["dur"]) for w in waits] == [
        (1_000, 1_000), (7_000, 2_000), (18_000, 4_000), (76_000, 6_000), (132_000, 8_000)]
    assert waits[2]["name"] == "wait L1 E0" and waits[2]["cname"] == "bad"
    load = next(e for e in _spans(chrome, cat="load") if e["name"] == "L0 E3")
    assert (load["ts"], load["dur"], load["tid"]) == (65_000, 17_000, 2)
    assert load["args"]["source"] == "prefetch" and load["args"]["bytes"] == 1 << 20


def test_every_track_nests(chrome):
    by_tid: dict[int, list[dict]] = {}
    for e in _spans(chrome):
        by_tid.setdefault(e["tid"], []).append(e)
    for tid, spans in by_tid.items():
        stack: list[float] = []  # end times of the open spans
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1] <= start + 1e-6:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-6, (tid, e["name"])
            stack.append(end)
        if tid != 0:  # reader tracks hold no nesting at all: one read at a time per lane
            ordered = sorted(spans, key=lambda e: e["ts"])
            for a, b in zip(ordered, ordered[1:], strict=False):
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-6


def test_overlapping_waits_are_serialised(tmp_path):
    """Waits on loads that finish close together: each wait starts where the previous ended;
    a wait hidden entirely behind another is not drawn and is counted."""
    trace = read_trace(write_handmade(tmp_path / "t"))
    extra = trace.loads.filter(trace.loads["step"] == 6).with_columns(
        finished_ns=pl.Series([138_000_000]), wait_ns=pl.Series([10_000_000]))  # 128..138 ms
    hidden = extra.with_columns(finished_ns=pl.Series([137_000_000]),
                                wait_ns=pl.Series([2_000_000]))  # 135..137 ms: covered
    loads = pl.concat([trace.loads, extra, hidden])
    data = chrome_trace(Trace(trace.path, trace.run, trace.steps, trace.routing, loads))
    waits = sorted((e["ts"], e["dur"]) for e in data["traceEvents"]
                   if e["ph"] == "X" and e["cat"] == "wait" and e["ts"] >= 120_000)
    assert waits == [(128_000, 10_000), (138_000, 2_000)]  # 132..140 clipped to 138..140
    assert data["otherData"]["waits_dropped"] == 1
