"""CPU time per step, every thread and the main thread, measured and simulated alike (the steps
table's cpu_ns and main_cpu_ns; traces.summary's cpu_ms_per_step and main_cpu_ms_per_step):
the engine's rows add up to the process CPU time the kernel counted around the run, the
simulator's rows to the CPU its cores handed out, and a trace written before the columns
existed reads them as unknown."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from sim_helpers import hardware, model, routing_input, scenario, uniform_routing

from sim.replay import simulate
from traces.reader import read_trace
from traces.summary import summarize

OLD = (Path(__file__).resolve().parents[1] / "reports" / "validation" / "traces"
       / "on-demand-pc25-unthrottled")  # a capture with the CPU columns


def test_the_engines_rows_add_up_to_the_process_cpu(tiny_random_converted, tmp_path):
    """The kernel's own count (time.process_time around the capture, every thread) against the
    rows' sum: the rows cover everything after the first step, so they are a little less, never
    more; the main thread's share is at most the process's on every row."""
    from engine.capture import capture, load_engine, start_recorder

    engine = load_engine(tiny_random_converted, preset="staged", lead="layer")
    try:
        rec = start_recorder(tmp_path / "t", engine)
        c0 = time.process_time_ns()
        with rec:
            capture(engine, ["one two three four", "five six"], 12, recorder=rec, temp=1.0)
        total = time.process_time_ns() - c0
    finally:
        engine.close()
    steps = read_trace(tmp_path / "t").steps
    rows = steps.filter(steps["cpu_ns"] >= 0)
    assert rows.height == steps.height - 1  # the first row has no previous one
    assert steps["cpu_ns"][0] == -1
    assert 0.5 * total < rows["cpu_ns"].sum() <= total
    assert (rows["main_cpu_ns"] <= rows["cpu_ns"] + 2_000_000).all()  # clock granularity
    assert (rows["main_cpu_ns"] > 0).all()


def test_the_simulators_rows_add_up_to_its_cores_work():
    hw = hardware(cpu_cores=2.0, compute_on_cpu=True)
    sc = scenario(hw, model(), path="staged", readers=2, lead="none", lookahead=False)
    router = uniform_routing(40, 2, 16, 2, seed=3)
    m = simulate(sc, routing_input(router))
    cols = m.main.log.cols
    busy = m.cores.busy_s
    assert sum(cols["cpu"]) == pytest.approx(sum(busy.values()), rel=1e-9)
    assert sum(cols["main_cpu"]) == pytest.approx(busy["main"], rel=1e-9)
    assert all(c >= mc >= 0 for c, mc in zip(cols["cpu"], cols["main_cpu"], strict=True))
    # each step's main-thread CPU is at least its graph building (2 layers x 1 ms)
    assert min(cols["main_cpu"]) >= 0.002 - 1e-12


@pytest.mark.skipif(not OLD.exists(), reason="no committed validation trace")
def test_a_trace_without_the_columns_reads_them_as_unknown(tmp_path):
    """A committed capture with its CPU columns taken out: as a trace written before them."""
    import polars as pl

    shutil.copytree(OLD, tmp_path / "old")
    cpu_columns = ("cpu_ns", "main_cpu_ns", "reader_cpu_ns")
    for part in (tmp_path / "old" / "steps").glob("*.parquet"):
        steps = pl.read_parquet(part)
        assert all(c in steps.columns for c in cpu_columns)  # else this checks nothing
        steps.drop(cpu_columns).write_parquet(part)
    t = read_trace(tmp_path / "old")
    assert all((t.steps[c] == -1).all() for c in ("cpu_ns", "main_cpu_ns", "reader_cpu_ns"))
    s = summarize(t)
    assert s["cpu_ms_per_step"] is None and s["main_cpu_ms_per_step"] is None
    assert s["reader_cpu_ms_per_step"] is None
    assert s["decode_tok_s"] is not None


def test_the_decode_steps_cpu_by_thread_adds_up_to_their_rows():
    """sim compare's CPU by thread (SimFigures.decode_cpu_ms_by_thread): over the decode steps,
    per step, main is the rows' main_cpu, and main + compute + the readers (as one) their cpu;
    prefill rows (whole-layer reads, on the readers too) are left out of both."""
    from sim.replay import run_scenario

    hw = hardware(cpu_cores=2.0, compute_on_cpu=True, load_overhead_ms=0.02,
                  cold_read_cpu_ms=0.05)
    sc = scenario(hw, model(), path="staged", readers=2, lead="none", lookahead=False)
    routing = routing_input(uniform_routing(40, 2, 16, 2, seed=3))
    routing.plan.insert(0, ("prefill", 8, 0, -1))
    result = run_scenario(sc, routing=routing)
    by_thread = result.figures.decode_cpu_ms_by_thread
    assert set(by_thread) == {"main", "compute", "readers"}
    steps = result.trace.steps
    decode = steps.filter(steps["phase"] == "decode")
    assert decode.height == result.figures.decode_steps < steps.height  # prefill rows too
    assert sum(by_thread.values()) == pytest.approx(decode["cpu_ns"].mean() / 1e6, rel=1e-6)
    assert by_thread["main"] == pytest.approx(decode["main_cpu_ns"].mean() / 1e6, rel=1e-6)
    assert by_thread["readers"] > 0
    assert by_thread["readers"] == pytest.approx(decode["reader_cpu_ns"].mean() / 1e6, rel=1e-6)


def test_the_main_threads_cpu_by_part_adds_up_to_it():
    """sim compare's main-thread CPU by part (SimFigures.decode_main_cpu_ms_by_part): the parts
    add up to the main thread's CPU of the decode steps; graph building is the model's build
    per layer (2 layers x 1 ms, sim_helpers.model) on every step; the loads the main thread
    reads itself and the lookahead loop's dispatch land in their own parts."""
    from sim.main_thread import MAIN_PARTS
    from sim.replay import run_scenario

    hw = hardware(cpu_cores=2.0, compute_on_cpu=True, load_overhead_ms=0.02,
                  cold_read_cpu_ms=0.05)
    m = model(fill_ms_per_layer=0.05, dispatch_cpu_ms_per_layer=0.1)
    for lookahead in (False, True):
        sc = scenario(hw, m, path="staged", readers=2, lead="none", lookahead=lookahead)
        result = run_scenario(sc, routing=routing_input(uniform_routing(40, 2, 16, 2, seed=3)))
        parts = result.figures.decode_main_cpu_ms_by_part
        assert tuple(parts) == MAIN_PARTS
        main = result.figures.decode_cpu_ms_by_thread["main"]
        assert sum(parts.values()) == pytest.approx(main, rel=1e-9)
        assert parts["build"] == pytest.approx(2.0, rel=1e-9)
        assert parts["loads"] > 0 and min(parts.values()) >= -1e-12
        assert parts["dispatch"] >= 2 * 0.1 - 1e-9  # at least each layer's dispatch CPU
        assert parts["other"] == pytest.approx(0.0, abs=1e-9)  # no token record charged here
