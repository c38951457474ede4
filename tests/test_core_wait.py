"""A thread back from the device waits for a core when every core is busy (sim.cpu.Cores.woken,
hardware core_wait_ms, calibration.core_wait_probe): hand-worked reads beside busy and free
cores, a whole run, the probe's conditional wait by hand, and the profile round trip."""

from __future__ import annotations

import polars as pl
import pytest
import simpy
from sim_helpers import hardware, model, scenario, uniform_routing
from sim_helpers import routing_input as to_input

from calibration.core_wait_probe import conditional_wait
from sim.cpu import Cores
from sim.gil import Gil
from sim.loads import Fetcher, Load
from sim.page_cache import PageCache
from sim.replay import run_scenario
from sim.storage import Device

NO_CPU = dict(load_overhead_ms=0.0, cold_overhead_ms=0.0, memcpy_gbps=0.0, readahead=False)


def _busy(cores: Cores, seconds: float, thread: str):
    yield cores.work(seconds, thread)


def _cold_read_ms(core_wait_ms: float, cores: float, busy_threads: int) -> tuple[float, int]:
    """A cold bundle read on reader0, three preads of 0.1 ms on the device and no CPU, while
    `busy_threads` other threads each run 10 ms of CPU from t=0: (its wall ms, the wakes that
    found every core busy)."""
    env = simpy.Environment()
    c = Cores(env, cores, core_wait_ms=core_wait_ms)
    f = Fetcher(env, hardware(**NO_CPU), Device(0.0001, 1e12), PageCache(10_000, 1000, 16), c,
                16, 1000, gil=Gil(env, True), bundle_reads=3)
    for i in range(busy_threads):
        env.process(_busy(c, 0.01, ("main", "compute")[i]))
    load = Load(0, 0, 3, 3, 1000, 1, "prefetch", 0.0, env.event())
    env.process(f.perform(load, "reader0"))
    env.run()
    return (load.finished - load.started) * 1e3, c.core_waits


def test_each_pread_back_from_the_device_waits_for_a_core_when_every_core_is_busy():
    # both cores busy: each of the three wakes waits 0.05 ms, 3 x (0.1 + 0.05)
    assert _cold_read_ms(0.05, 2, 2) == (pytest.approx(0.45, abs=1e-5), 3)
    # one core free (one busy thread on two cores), no wait figure, cores not modelled:
    # three device requests back to back and nothing else
    assert _cold_read_ms(0.05, 2, 1) == (pytest.approx(0.3, abs=1e-5), 0)
    assert _cold_read_ms(0.0, 2, 2) == (pytest.approx(0.3, abs=1e-5), 0)
    assert _cold_read_ms(0.05, 0, 2) == (pytest.approx(0.3, abs=1e-5), 0)
    # a background core's worth of other processes: one busy thread fills the core left
    env = simpy.Environment()
    c = Cores(env, 2, background=1.0, core_wait_ms=0.05)
    env.process(_busy(c, 0.01, "main"))
    env.run(until=0.001)
    assert c.woken() is not None and c.core_waits == 1


def _lead_run(core_wait_ms: float, cores: float):
    """The layer lead's prefetches on two readers beside the main and compute threads."""
    m = model(layers=6, experts=64, k=4, build_ms_per_layer=0.3, consumer_first=1,
              consumer_last=5, heads=5, head_bytes=0)
    hw = hardware(cpu_cores=cores, compute_on_cpu=True, cold_overhead_ms=0.1,
                  ssd_latency_ms=0.05, ssd_bandwidth_gbps=50.0, mem_bandwidth_gbps=2.0,
                  readahead=False, core_wait_ms=core_wait_ms)
    sc = scenario(hw=hw, m=m, path="staged", lead="layer", readers=2, decode_steps=60,
                  lookahead=True, o_direct=True)
    return run_scenario(sc, routing=to_input(uniform_routing(60, 6, 64, 4, seed=3)))


def test_reads_beside_busy_cores_take_longer_in_a_whole_run():
    def read_ms(run) -> float:
        loads = run.trace.loads.filter(pl.col("thread").str.starts_with("reader"))
        return float(((loads["finished_ns"] - loads["started_ns"]) / 1e6).mean())

    plain, waiting = _lead_run(0.0, 2), _lead_run(0.2, 2)
    assert read_ms(waiting) > read_ms(plain) + 0.05  # some of the reads' wakes wait 0.2 ms
    # enough cores for every thread: no wake ever finds them all busy
    roomy, roomy_waiting = _lead_run(0.0, 8), _lead_run(0.2, 8)
    assert read_ms(roomy_waiting) == pytest.approx(read_ms(roomy))
    assert roomy_waiting.metrics["decode_tok_s"] == pytest.approx(roomy.metrics["decode_tok_s"])


def test_the_probe_divides_the_extra_wait_per_wake_by_the_chance_every_core_is_busy():
    # 0.030 ms a wake beside decode, 0.002 alone; the two busiest threads run 0.7 and 0.5 of a
    # core: both at once 0.35 of the time, so a wake that finds them busy waits 0.028 / 0.35
    assert conditional_wait(0.030, 0.002, [0.5, 0.1, 0.7], 2) == pytest.approx(0.08)
    assert conditional_wait(0.001, 0.002, [0.5, 0.7], 2) == 0.0  # never below alone
    assert conditional_wait(0.030, 0.002, [0.7], 2) is None  # fewer threads than cores
    assert conditional_wait(0.030, 0.002, [0.7, 0.0], 2) is None  # never all busy


def test_core_wait_round_trips_the_profile_and_a_bad_value_is_one_line(tmp_path):
    from profile_helpers import assert_profile_round_trip

    assert_profile_round_trip(tmp_path, "core_wait_ms", 0.0771,
                              {"core_wait_how": "600 cold reads beside decode"}, -0.1,
                              "core_wait_ms.*must be >= 0")
