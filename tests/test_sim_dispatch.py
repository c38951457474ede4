"""MLX's dispatch on the main thread beside its compute thread (sim.compute_stream's dispatch
wait, sim.main_thread's owed dispatch): hand-worked timelines and closed forms."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import simpy
from sim_helpers import MB, hardware, model, routing_input, scenario

from sim.compute_stream import ComputeStream
from sim.cpu import Cores
from sim.replay import run_scenario


def _item_beside_dispatch(cores: float, share: float, dispatch_s: float) -> tuple[float, float]:
    """One 10 s compute item, its first (1 - share) x 10 s a wait for dispatch, handed over at
    t=0 while the main thread dispatches for `dispatch_s` of CPU from t=0: (the item's finish,
    the compute thread's CPU)."""
    env = simpy.Environment()
    cpu = Cores(env, cores)
    stream = ComputeStream(env, cpu, lazy=False)
    seen = {}

    def host():
        stream.submit(10.0, wait=10.0 * (1 - share))
        if dispatch_s:
            env.process(_main(dispatch_s))
        yield stream.sync()
        seen["done"] = env.now

    def _main(seconds):
        yield cpu.work(seconds, "main")

    env.process(host())
    env.run()
    return seen["done"], cpu.busy_s["compute"]


@pytest.mark.parametrize(("cores", "share", "dispatch", "done"), [
    (1, 1.0, 0.0, 10.0),   # all of the item is the compute thread's CPU
    (1, 0.6, 0.0, 10.0),   # 4 s waiting for a dispatch that costs nothing, then 6 s of CPU
    (1, 0.6, 3.0, 10.0),   # the dispatch fits in the 4 s the compute thread waits
    (1, 0.6, 7.0, 13.0),   # it does not: one core runs 7 s of dispatch and 6 s of compute
    (1, 1.0, 7.0, 17.0),   # no wait to fit it in: the main thread runs first (sim.cpu)
    (2, 0.6, 7.0, 10.0),   # two cores: the dispatch runs beside the compute thread
])
def test_an_item_waits_for_dispatch_then_computes(cores, share, dispatch, done):
    finish, compute_cpu = _item_beside_dispatch(cores, share, dispatch)
    assert finish == pytest.approx(done)
    assert compute_cpu == pytest.approx(10.0 * share)


def _steps(cores: float, wait_ms: float, dispatch_ms: float,
           lookahead: bool = False, layers: int = 1, fill_ms: float = 0.0) -> pl.DataFrame:
    """The synchronous loop (or the lookahead loop, its queue bound 0: each hand-over waits for
    the compute it queued), `layers` layers of 1 ms compute in all (10^6 bytes of resident
    weights at 1 GB/s), build 0.5 ms a layer, every expert in the hot pool after the first
    step, `fill_ms` the lookahead loop's serial dispatch a layer (model fill_ms_per_layer): the
    last decode steps' rows. (One layer: nothing else is queued when its attention is handed
    over.)"""
    m = model(layers=layers, experts=16, k=2, build_ms_per_layer=0.5, resident_bytes=1_000_000,
              dispatch_cpu_ms_per_layer=dispatch_ms, compute_wait_ms_per_layer=wait_ms,
              fill_ms_per_layer=fill_ms)
    hw = hardware(mem_bandwidth_gbps=1.0, expert_gbps=1e9, cpu_cores=cores,
                  compute_on_cpu=True, queue_ahead_ms=0.0 if lookahead else math.inf)
    router = np.array([[[0, 1]] * layers] * 8, dtype=np.int16)
    sc = scenario(hw=hw, m=m, path="hot", lru_bytes=16 * MB, decode_steps=8,
                  lookahead=lookahead)
    steps = run_scenario(sc, routing=routing_input(router)).trace.steps
    # (the lookahead loop's last row is the empty window after the request's last token)
    return steps.filter((pl.col("phase") == "decode") & (pl.col("eval_ns") > 0)).tail(3)


def _ms(frame: pl.DataFrame, column: str) -> list[float]:
    return [v / 1e6 for v in frame[column].to_list()]


@pytest.mark.parametrize("lookahead", [False, True])
def test_dispatch_is_main_thread_cpu_and_free_on_two_cores(lookahead):
    """Two cores: the layer's dispatch (0.3 ms) runs on the main thread while it waits on the
    layer's 1 ms of compute. The main thread's CPU grows by 0.3 ms a step, the compute
    thread's falls by the 0.3 ms it waits for it; no step is longer."""
    base, paid = _steps(2, 0.0, 0.0, lookahead), _steps(2, 0.3, 0.3, lookahead)
    assert _ms(paid, "eval_ns") == pytest.approx(_ms(base, "eval_ns"), abs=1e-6)
    main = [p - b for p, b in zip(_ms(paid, "main_cpu_ns"), _ms(base, "main_cpu_ns"),
                                  strict=True)]
    assert main == pytest.approx([0.3] * 3, abs=1e-6)
    other = [(p - pm) - (b - bm) for p, pm, b, bm in zip(
        _ms(paid, "cpu_ns"), _ms(paid, "main_cpu_ns"), _ms(base, "cpu_ns"),
        _ms(base, "main_cpu_ns"), strict=True)]
    assert other == pytest.approx([-0.3] * 3, abs=1e-6)


@pytest.mark.parametrize(("wait", "dispatch", "more_ms"), [
    (0.0, 0.3, 0.3),   # one core, no wait to hide it in: 0.3 ms more eval a step
    (0.3, 0.3, 0.0),   # the dispatch fills the compute thread's 0.3 ms wait
    (0.3, 0.5, 0.2),   # 0.2 ms of it does not fit there
    (0.3, 0.0, -0.3),  # the wait was a dispatch that costs nothing: the layer's CPU less it
])
def test_one_core_pays_the_dispatch_the_compute_thread_does_not_wait_for(wait, dispatch,
                                                                         more_ms):
    """On one core the compute thread's wait for the dispatch (measured on two) is the main
    thread's dispatch itself: the layer's compute is its CPU less the wait, and the dispatch
    runs on the same core."""
    base, paid = _steps(1, 0.0, 0.0), _steps(1, wait, dispatch)
    more = [p - b for p, b in zip(_ms(paid, "eval_ns"), _ms(base, "eval_ns"), strict=True)]
    assert more == pytest.approx([more_ms] * 3, abs=1e-6)


@pytest.mark.parametrize(("fill", "dispatch", "more_ms"), [
    (0.3, 0.3, 4 * 0.3),         # calibrate's profile (both figures one measurement): once each
    (0.1, 0.3, 3 * 0.1 + 0.3 + 2 * 0.2),  # a smaller serial part: the rest is still owed
    (0.0, 0.3, 3 * 0.3),         # no serial part: the owed dispatch alone, as before
])
def test_the_lookahead_loop_dispatches_each_layer_once(fill, dispatch, more_ms):
    """Three layers whose routers the host waits for (the hot path's fill points), two cores.
    Per step the main thread dispatches the walk to each of the 3 routers and the walk to the
    logits once: the serial dispatch at each fill point (`fill`: the gather and the walk to the
    next router) and the owed dispatch (`dispatch`) of what that left out, for layer 0's walk
    (handed over at the step boundary) all of it. Hand-worked: 3 x fill + dispatch +
    2 x (dispatch - fill); the request's last step hands no next step's layer 0 over, so it
    has `dispatch` less. Charging the owed dispatch in full beside the serial one counted the
    walks twice (1.8 ms for the first row, where the engine spends 1.2)."""
    base = _steps(2, 0.0, 0.0, lookahead=True, layers=3)
    paid = _steps(2, 0.0, dispatch, lookahead=True, layers=3, fill_ms=fill)
    more = [p - b for p, b in zip(_ms(paid, "main_cpu_ns"), _ms(base, "main_cpu_ns"),
                                  strict=True)]
    assert more == pytest.approx([more_ms, more_ms, more_ms - dispatch], abs=1e-6)


@pytest.mark.parametrize("cores", [1, 2])
def test_one_core_never_idles_while_the_threads_have_work(cores):
    """The lookahead loop as calibrate profiles it: the serial dispatch at each fill point
    (fill 0.3 ms) is all of the layer's dispatch (0.3 ms), so nothing is owed when the next
    attention, whose first 0.2 ms the compute thread waits for dispatch, is handed over and
    the host waits on the bounded queue. On one core nothing else can run then: a decode step
    takes exactly the CPU the threads spend (every operation is work on the one core), where
    a wait kept as a timeout left the core idle 0.2 ms a layer with both threads waiting. On
    two cores the compute thread does wait beside the main thread's dispatch: steps take
    longer than their CPU over two cores."""
    rows = _steps(cores, 0.2, 0.3, lookahead=True, layers=3, fill_ms=0.3)
    wall = [(e - s) / 1e6 for s, e in zip(rows["start_ns"], rows["end_ns"], strict=True)]
    cpu = _ms(rows, "cpu_ns")
    if cores == 1:
        assert wall == pytest.approx(cpu, abs=1e-6)
    else:
        assert all(w > c / 2 + 0.1 for w, c in zip(wall, cpu, strict=True))
