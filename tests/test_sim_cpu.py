"""The host's cores (sim.cpu, processor sharing) and the compute stream (sim.compute_stream)
against hand-worked timelines, and the whole model's CPU contention against closed forms."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import simpy
from sim_helpers import MB, hardware, model, routing_input, scenario, uniform_routing

from sim.compute_stream import ComputeStream
from sim.cpu import Cores
from sim.replay import run_scenario


def _finish_times(cores: float, jobs: list[tuple[float, float]], background: float = 0.0,
                  threads: list[str] | None = None):
    """(arrival, CPU seconds) per job -> finish times."""
    env = simpy.Environment()
    cpu = Cores(env, cores, background)
    out = [0.0] * len(jobs)
    names = threads or [f"t{i}" for i in range(len(jobs))]

    def job(i: int, arrival: float, seconds: float):
        yield env.timeout(arrival)
        yield cpu.work(seconds, names[i])
        out[i] = env.now

    for i, (a, s) in enumerate(jobs):
        env.process(job(i, a, s))
    env.run()
    return out


def test_processor_sharing_by_hand():
    # one core, jobs of 1 s and 2 s from t=0: both at half speed until the first is done at
    # t=2 (it had 1 s); the second then runs alone for its last 1 s
    assert _finish_times(1, [(0, 1), (0, 2)]) == pytest.approx([2.0, 3.0])
    # two cores, three 1 s jobs: each gets 2/3 of a core, all done at 1.5 s
    assert _finish_times(2, [(0, 1)] * 3) == pytest.approx([1.5] * 3)
    # two cores, two jobs: no sharing at all
    assert _finish_times(2, [(0, 1), (0, 1)]) == pytest.approx([1.0, 1.0])
    # a late arrival: job 0 alone on one core for 0.5 s, then both at half speed: job 0 has
    # 0.5 s left -> done at 1.5; job 1 got 0.5 s by then, runs alone: done at 2.0
    assert _finish_times(1, [(0, 1), (0.5, 1)]) == pytest.approx([1.5, 2.0])
    # other processes keep half a core busy: a 1 s job on one core takes 2 s
    assert _finish_times(1, [(0, 1)], background=0.5) == pytest.approx([2.0])


def test_threads_that_sleep_run_before_the_compute_thread():
    """The kernel's scheduler lets a thread waking for a short burst (main, readers) take a
    core from the compute thread (sim.cpu): the compute thread gets what the others leave."""
    both = ["main", "compute"]
    # one core, main 1 s and compute 2 s from t=0: main runs alone (done at 1), then compute
    assert _finish_times(1, [(0, 1), (0, 2)], threads=both) == pytest.approx([1.0, 3.0])
    # a main-thread burst arriving while compute runs takes the core at once
    assert _finish_times(1, [(0.5, 1), (0, 2)], threads=both) == pytest.approx([1.5, 3.0])
    # two cores, main, a reader and compute, 1 s each: main and the reader have a core each,
    # compute starts when they are done
    assert _finish_times(2, [(0, 1)] * 3, threads=["main", "reader0", "compute"]) == \
        pytest.approx([1.0, 1.0, 2.0])
    # half a core (a CPU quota): main at half speed, done at 2; then compute at half speed
    assert _finish_times(0.5, [(0, 1), (0, 1)], threads=both) == pytest.approx([2.0, 4.0])
    # among the sleepers, processor sharing: main and a reader on one core
    assert _finish_times(1, [(0, 1), (0, 1)], threads=["main", "reader0"]) == \
        pytest.approx([2.0, 2.0])
    # two compute jobs share what is left beside main: one core, main 1 s, compute 1 s each
    assert _finish_times(1, [(0, 1), (0, 1), (0, 1)], threads=["main", "compute", "compute"]) \
        == pytest.approx([1.0, 3.0, 3.0])


def test_unbounded_cores_are_plain_timeouts():
    assert _finish_times(0, [(0, 1), (0, 2), (0.5, 1)]) == pytest.approx([1.0, 2.0, 1.5])


@pytest.mark.parametrize("shortcut", [True, False])
def test_lazy_stream_runs_at_the_sync_and_sync_overhead_applies(shortcut):
    env = simpy.Environment()
    stream = ComputeStream(env, None, lazy=True, sync_s=0.25, shortcut=shortcut)
    seen = {}

    def host():
        stream.submit(1.0)
        yield env.timeout(2.0)
        assert stream.busy_s == 0.0  # lazy: nothing ran before the sync
        yield stream.sync()
        seen["t"] = env.now

    env.process(host())
    env.run()
    assert seen["t"] == pytest.approx(2.0 + 1.0 + 0.25)


def test_compute_on_the_cpu_competes_with_the_main_thread():
    env = simpy.Environment()
    cpu = Cores(env, 1)
    stream = ComputeStream(env, cpu, lazy=False)
    seen = {}

    def host():
        stream.submit(1.0)
        yield cpu.work(1.0, "main")  # graph building beside the compute thread, one core
        seen["build"] = env.now
        yield stream.sync()
        seen["sync"] = env.now

    env.process(host())
    env.run()
    # the main thread's building runs first (sim.cpu); compute has the core after it
    assert seen == {"build": pytest.approx(1.0), "sync": pytest.approx(2.0)}


def _lookahead_run(cores: float, compute_on_cpu: bool, shortcut: bool = True):
    # 4 layers, build 1 ms per layer, compute 0.84 ms per layer, no storage costs
    m = model(layers=4, experts=16, k=2, resident_bytes=320 * MB, build_ms_per_layer=1.0)
    hw = hardware(mem_bandwidth_gbps=100.0, expert_gbps=1e9, ssd_latency_ms=0.0,
                  ssd_bandwidth_gbps=1e12, load_overhead_ms=0.0, cold_overhead_ms=0.0,
                  memcpy_gbps=0.0, cpu_cores=cores, compute_on_cpu=compute_on_cpu)
    router = uniform_routing(200, 4, 16, 2, seed=3)
    sc = scenario(hw=hw, m=m, path="hot", lru_bytes=64 * 16 * MB, readers=1,
                  decode_steps=200, lookahead=True)
    import sim.replay as replay

    saved = replay.ComputeStream
    if not shortcut:  # the accelerator as a process, not a timeline
        replay.ComputeStream = lambda *a, **kw: saved(*a, **kw, shortcut=False)
    try:
        res = run_scenario(sc, routing=routing_input(router))
    finally:
        replay.ComputeStream = saved
    steps = res.trace.steps.filter(pl.col("phase") == "decode")
    return float(steps["end_ns"].diff().drop_nulls().median()) / 1e6, res


def test_one_core_serialises_building_and_compute_two_overlap():
    # compute per layer a = 80 MiB / 100 GB/s = 0.839 ms (+ ~0 experts); build b = 1 ms
    a = 80 * MB / 100e9 * 1e3
    one, res1 = _lookahead_run(1, True)
    two, _ = _lookahead_run(2, True)
    gpu, _ = _lookahead_run(1, False)
    # one core: the core is never idle (the main thread waits only on compute, compute only
    # on the main thread's fills), so a step is all the CPU work: 4 builds + 4 layers' compute
    assert one == pytest.approx(4 * (1.0 + a), rel=1e-6)
    # two cores: each layer's compute (queued at the previous fill point) runs beside the next
    # layer's build and is done by the time its fill point syncs: building paces the step
    assert two == pytest.approx(4 * 1.0, rel=1e-6)
    assert gpu == pytest.approx(two, rel=1e-6)  # an accelerator does not take a core
    assert res1.figures.cpu_contended_fraction > 0.5


def test_enough_cores_give_the_unbounded_model_exactly():
    a, ra = _lookahead_run(0, True)
    b, rb = _lookahead_run(64, True)
    assert a == b
    assert ra.trace.steps["end_ns"].to_list() == rb.trace.steps["end_ns"].to_list()


def test_the_accelerator_timeline_equals_the_accelerator_process():
    _, timeline = _lookahead_run(1, False)
    _, process = _lookahead_run(1, False, shortcut=False)
    assert timeline.trace.steps["end_ns"].to_list() == process.trace.steps["end_ns"].to_list()
    assert timeline.trace.steps["eval_ns"].to_list() == process.trace.steps["eval_ns"].to_list()


@pytest.mark.parametrize("shortcut", [True, False])
def test_a_bounded_queue_returns_once_little_is_left(shortcut):
    """MLX's async_eval on its CPU backend returns once <= 10 operations are in flight: the
    stream's `submit_async` returns when at most queue_ahead_s of the queued work is left.
    By hand, q = 0.5 s, both ways of running the stream (timeline and process):
      t=0  hand over 1.0 -> wait until 0.5 left: t = 0.5
      t=0  also 0.2 (shorter than q): 1.2 queued, wait until 0.5 left: t = 0.7
      t=0.7 hand over 0.3 (<= q) with 0.5 + 0.3 queued: wait until 0.5 left: t = 1.0
      t=1.0 hand over 2.0: everything queued ends at 3.5; wait until 0.5 left: t = 3.0"""
    env = simpy.Environment()
    stream = ComputeStream(env, None, lazy=False, shortcut=shortcut, queue_ahead_s=0.5)
    seen: list[float] = []

    def host():
        first = stream.submit_async(1.0)
        second = stream.submit_async(0.2)
        yield first
        seen.append(env.now)
        yield second
        seen.append(env.now)
        yield stream.submit_async(0.3)
        seen.append(env.now)
        yield stream.submit_async(2.0)
        seen.append(env.now)
        yield stream.sync()
        seen.append(env.now)

    env.process(host())
    env.run()
    assert seen == pytest.approx([0.5, 0.7, 1.0, 3.0, 3.5])


@pytest.mark.parametrize("shortcut", [True, False])
def test_an_unbounded_or_short_queue_never_waits(shortcut):
    env = simpy.Environment()
    unbounded = ComputeStream(env, None, lazy=False, shortcut=shortcut)
    assert unbounded.submit_async(1.0) is None
    roomy = ComputeStream(env, None, lazy=False, shortcut=shortcut, queue_ahead_s=2.0)
    assert roomy.submit_async(1.0) is None and roomy.submit_async(1.0) is None
    assert roomy.submit_async(0.5) is not None  # 2.5 queued > 2.0


def _one_token_steps(cores: float, thread_cores: float, cross_us: float, main_us: float,
                     fill_ms: float, lookahead: bool) -> pl.DataFrame:
    """2 layers, each 1 ms of compute (1 MB of resident weights at 1 GB/s) in 100 primitives,
    every expert in the hot pool after the first step: the last decode steps' figures."""
    m = model(layers=2, experts=16, k=2, build_ms_per_layer=0.5, resident_bytes=2 * MB,
              primitives_per_layer=100, fill_ms_per_layer=fill_ms)
    hw = hardware(mem_bandwidth_gbps=1.0, expert_gbps=1e9, cpu_cores=cores,
                  thread_cores=thread_cores, compute_on_cpu=True, cross_core_op_us=cross_us,
                  cross_core_op_main_us=main_us, queue_ahead_ms=0.0 if lookahead else math.inf)
    router = np.array([[[0, 1], [2, 3]]] * 8, dtype=np.int16)
    sc = scenario(hw=hw, m=m, path="hot", lru_bytes=16 * MB, decode_steps=8, lookahead=lookahead)
    steps = run_scenario(sc, routing=routing_input(router)).trace.steps
    return steps.filter(pl.col("phase") == "decode").tail(3)


@pytest.mark.parametrize(("cores", "thread_cores", "shared"),
                         [(1, 0, True), (2, 0, False), (0.5, 2, False)])
def test_one_core_hands_work_over_without_crossing_cores(cores, thread_cores, shared):
    """The compute figures are measured with the main and compute threads on two cores, where
    each MLX operation handed over costs cross_core_op_us more wall time than on one. On one
    core (a cpuset) each layer's compute takes primitives x that less: the synchronous loop
    waits on every layer's compute, so a step's eval is 2 layers x 100 x 2 us = 0.4 ms shorter.
    Two cores, or half a core's time spread over two (a CFS quota), hand across cores: no
    change."""
    def eval_ns(cross_us: float) -> list[int]:
        return _one_token_steps(cores, thread_cores, cross_us, 0.0, 0.0, False)["eval_ns"].to_list()

    saved = [a - b for a, b in zip(eval_ns(0.0), eval_ns(2.0), strict=True)]
    assert saved == [pytest.approx(400_000 if shared else 0, abs=2)] * 3


def test_one_core_dispatches_without_crossing_cores():
    """The lookahead loop's dispatch at each fill point (fill_ms_per_layer, 0.3 ms, measured
    with the threads on two cores) is main-thread CPU compute waits on; on one core each
    primitive's share, cross_core_op_main_us (1 us), is not paid: the dispatch's part of a
    step's eval, eval(fill 0.3) - eval(fill 0), is 2 x (0.3 - 100 x 1 us) = 0.4 ms, 0.6 without
    the mechanism."""
    def dispatch_ns(main_us: float) -> list[int]:
        with_fill, without = (_one_token_steps(1, 0, 0.0, main_us, fill, True)["eval_ns"]
                              for fill in (0.3, 0.0))
        return (with_fill - without).to_list()

    assert dispatch_ns(0.0) == [pytest.approx(600_000, abs=2)] * 3
    assert dispatch_ns(1.0) == [pytest.approx(400_000, abs=2)] * 3
