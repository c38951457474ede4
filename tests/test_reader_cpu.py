"""The reader threads' CPU time (engine.readers.ReaderPool.cpu_ns, the steps table's
reader_cpu_ns, traces.summary's reader_cpu_ms_per_step): checked against the kernel's own
per-task accounting of the pool's threads (/proc/self/task/TID/schedstat, the threads that
appeared when the pool started), never against the main thread's work; the recorder's rows
carry it; the simulator's rows split off its readers' CPU alike."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from sim_helpers import hardware, model, routing_input, scenario, uniform_routing
from store_helpers import expert_buffers

from engine import native_reads
from engine.readers import ReaderPool
from sim.replay import simulate
from traces.reader import read_trace
from traces.summary import cpu_by_thread

TASKS = Path("/proc/self/task")
needs_schedstat = pytest.mark.skipif(
    not (TASKS / str(os.getpid()) / "schedstat").exists(), reason="no per-task schedstat")
lib, why = native_reads.load()


def _tasks() -> set[str]:
    return set(os.listdir(TASKS))


def _kernel_cpu_ns(tids: set[str]) -> int:
    """sum_exec_runtime of `tids` (schedstat's first field), ns."""
    return sum(int((TASKS / t / "schedstat").read_text().split()[0]) for t in tids)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@needs_schedstat
@pytest.mark.parametrize("kind", ["python", "native"])
def test_the_pools_cpu_is_its_threads_as_the_kernel_counts_them(store, kind):
    if kind == "native" and lib is None:
        pytest.skip(f"native reads unavailable: {why}")
    layer = store.manifest.moe_layers[0]
    before = _tasks()
    pool = ReaderPool(store, 2, native=kind == "native")
    try:
        assert pool.cpu_ns() == 0  # no thread started yet
        for _ in range(3):
            tickets = [pool.submit_bundle(layer, e, expert_buffers(store, layer))
                       for e in range(store.manifest.num_experts)]
            pool.wait(tickets)
        threads = _tasks() - before
        assert len(threads) == 2  # the pool's own, started on first use
        reference0 = _kernel_cpu_ns(threads)
        got = pool.cpu_ns()
        reference1 = _kernel_cpu_ns(threads)
        assert got > 0
        assert reference0 - 100_000 <= got <= reference1 + 100_000
        _spin(0.05)  # the main thread's work is not the readers'
        assert pool.cpu_ns() - got < 10_000_000
    finally:
        pool.close()


def test_the_recorders_rows_carry_the_readers_cpu(tiny_random_converted, tmp_path):
    """Staged with a layer lead reads on reader threads: its decode rows count their CPU, at
    most the process's less the main thread's (clock granularity aside), and in all no more
    than the pool's total; on demand every read is the main thread's: its rows count none."""
    from engine.capture import capture, load_engine, start_recorder

    totals = {}
    for preset, lead in (("staged", "layer"), ("on-demand", "none")):
        engine = load_engine(tiny_random_converted, preset=preset, lead=lead,
                             page_cache_fraction=0.25)
        try:
            rec = start_recorder(tmp_path / preset, engine)
            with rec:
                capture(engine, ["one two three four", "five six"], 12, recorder=rec, temp=1.0)
            totals[preset] = engine.runtime.readers.cpu_ns()
        finally:
            engine.close()
        steps = read_trace(tmp_path / preset).steps
        rows = steps.filter(steps["cpu_ns"] >= 0)
        assert rows.height == steps.height - 1 and steps["reader_cpu_ns"][0] == -1
        assert (rows["reader_cpu_ns"] >= 0).all()
        assert (rows["reader_cpu_ns"] + rows["main_cpu_ns"] <= rows["cpu_ns"] + 4_000_000).all()
        assert rows["reader_cpu_ns"].sum() <= totals[preset]
        if preset == "on-demand":
            assert rows["reader_cpu_ns"].sum() == 0 == totals[preset]
        else:
            assert rows.filter(rows["phase"] == "decode")["reader_cpu_ns"].sum() > 0


def test_the_simulators_rows_split_off_its_readers():
    hw = hardware(cpu_cores=2.0, compute_on_cpu=True, load_overhead_ms=0.02,
                  cold_read_cpu_ms=0.05)
    sc = scenario(hw, model(), path="staged", readers=2, lead="none", lookahead=False)
    m = simulate(sc, routing_input(uniform_routing(40, 2, 16, 2, seed=3)))
    cols, busy = m.main.log.cols, m.cores.busy_s
    readers = sum(s for t, s in busy.items() if t.startswith("reader"))
    assert readers > 0
    assert sum(cols["reader_cpu"]) == pytest.approx(readers, rel=1e-9)
    assert all(c >= mc + rc - 1e-12 for c, mc, rc in
               zip(cols["cpu"], cols["main_cpu"], cols["reader_cpu"], strict=True))


def test_cpu_by_thread_splits_the_summary():
    """Hand-worked: compute is the process less the main and reader threads; a trace without
    the readers' column keeps them with compute."""
    summary = {"cpu_ms_per_step": 10.0, "main_cpu_ms_per_step": 4.0,
               "reader_cpu_ms_per_step": 1.5}
    assert cpu_by_thread(summary) == {"compute": 4.5, "main": 4.0, "readers": 1.5}
    old = {**summary, "reader_cpu_ms_per_step": None}
    assert cpu_by_thread(old) == {"main": 4.0, "compute and readers": 6.0}
    assert cpu_by_thread({}) == {"main": None, "compute and readers": None}
