"""The measured figures sim.compare reads off a trace for the fits, by hand: a reader's start
delay, blocked time past the loads, a cold read's cost, build per cold read."""

from __future__ import annotations

import pytest


def test_reader_start_delay_counts_only_loads_handed_to_an_idle_reader():
    """sim.compare.reader_start_ms by hand: a reader's load issued while its previous one was
    still reading waited in the queue, not for a wake-up; the main thread's loads are not
    readers' and prefill's are not decode's."""
    from types import SimpleNamespace

    import polars as pl

    from sim.compare import reader_start_ms

    steps = pl.DataFrame({"step": [0, 1], "phase": ["prefill", "decode"]})
    rows = [  # (step, thread, issued, started, finished) in ns
        (1, "reader-0", 1_000, 1_300, 2_000),  # idle: 300
        (1, "reader-0", 1_500, 2_050, 3_000),  # queued behind the one before: not a wake
        (1, "reader-0", 4_000, 4_100, 5_000),  # idle: 100
        (1, "reader-1", 1_000, 1_600, 1_900),  # idle: 600
        (1, "main", 1_000, 9_000, 9_500),
        (0, "reader-1", 0, 50_000, 60_000),  # prefill
    ]
    loads = pl.DataFrame(rows, schema=["step", "thread", "issued_ns", "started_ns",
                                       "finished_ns"], orient="row")
    trace = SimpleNamespace(steps=steps, loads=loads)
    assert reader_start_ms(trace) == pytest.approx(300 / 1e6)  # median of 300, 100, 600
    assert reader_start_ms(SimpleNamespace(steps=steps, loads=loads.filter(
        pl.col("thread") == "main"))) is None


def test_blocked_past_loads_and_cold_read_by_hand():
    """sim.compare.blocked_past_loads_ms by hand: per fill (a decode step's layer with expert
    loads), the main thread's blocked time beyond its loads' span, first issue to last
    finish. Step 1 blocked 3000 ns over fills of span 1400 (two loads, 100 -> 1500) and 500;
    step 2 blocked 1000 over one of 800: (4000 - 2700) / 3 fills = 433.3 ns. Prefill's loads
    and a whole-layer load (expert -1) are not a fill's. cold_read_ms: the mean start to
    finish of the decode steps' cold expert loads on any thread, (800 + 500) / 2 ns."""
    from types import SimpleNamespace

    import polars as pl

    from sim.compare import blocked_past_loads_ms, cold_read_ms

    steps = pl.DataFrame({"step": [0, 1, 2], "phase": ["prefill", "decode", "decode"],
                          "blocked_ns": [90_000, 3_000, 1_000]})
    rows = [  # (step, layer, expert, thread, cold, issued, started, finished) in ns
        (1, 0, 3, "main", False, 100, 100, 1_100),
        (1, 0, 5, "reader-0", True, 200, 700, 1_500),
        (1, 1, 2, "main", True, 2_000, 2_000, 2_500),
        (2, 0, 1, "reader-1", False, 0, 100, 800),
        (0, 0, 1, "main", True, 0, 0, 50_000),  # prefill
        (1, 2, -1, "main", True, 0, 0, 70_000),  # a whole layer
    ]
    loads = pl.DataFrame(rows, schema=["step", "layer", "expert", "thread", "cold",
                                       "issued_ns", "started_ns", "finished_ns"], orient="row")
    trace = SimpleNamespace(steps=steps, loads=loads)
    assert blocked_past_loads_ms(trace) == pytest.approx(1300 / 3 / 1e6)
    assert cold_read_ms(trace) == pytest.approx(650 / 1e6)
    warm = SimpleNamespace(steps=steps, loads=loads.filter(~pl.col("cold")))
    assert cold_read_ms(warm) is None
    none = SimpleNamespace(steps=steps, loads=loads.filter(pl.col("step") == 0))
    assert blocked_past_loads_ms(none) is None


def test_build_per_cold_read_is_the_slope_over_the_decode_steps_by_hand():
    """sim.compare.build_per_cold_read_ms by hand: the least-squares slope of build time over
    cold loads per decode step. Steps (cold, build ms): (0, 2.0), (2, 2.1), (4, 2.3), (6, 2.6)
    -> slope = sum((x - 3)(y - 2.25)) / sum((x - 3)^2) = 2.0 / 20 = 0.1 ms per cold read (the
    intercept, 1.95 ms in this capture, is not in it); prefill's steps are not decode's."""
    from types import SimpleNamespace

    import polars as pl

    from sim.compare import build_per_cold_read_ms

    steps = pl.DataFrame({"phase": ["prefill", "decode", "decode", "decode", "decode"],
                          "cold_loads": [40, 0, 2, 4, 6],
                          "build_ns": [90_000_000, 2_000_000, 2_100_000, 2_300_000, 2_600_000]})
    assert build_per_cold_read_ms(SimpleNamespace(steps=steps)) == pytest.approx(0.1)
    # another capture, 1 ms slower on every step: the same slope
    slower = steps.with_columns(pl.col("build_ns") + 1_000_000)
    assert build_per_cold_read_ms(SimpleNamespace(steps=slower)) == pytest.approx(0.1)
    # every step as cold as the others: no slope to read
    flat = steps.with_columns(pl.lit(3).alias("cold_loads"))
    assert build_per_cold_read_ms(SimpleNamespace(steps=flat)) is None
