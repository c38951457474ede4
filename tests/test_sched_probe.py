"""The scheduler probe (calibration.sched_probe) -> the hardware's reader_cpu_weight -> the
simulated cores (sim.cpu): the weight from a burst's rate by the closed form, the probe's
arms and floor on synthetic rates, the profile round trip, and one line for a bad weight."""

from __future__ import annotations

import pytest
from sim_helpers import hardware, model, scenario, uniform_routing
from sim_helpers import routing_input as to_input

from calibration import sched_probe
from sim.cpu import weighted_shares
from sim.replay import run_scenario


def test_weight_from_rate_is_the_inverse_of_weighted_sharing():
    # r = w / (w + 1): plain sharing (w = 1) gives a burst half a core beside one spinner each
    for w in (1.0, 3.0, 9.0, 99.0):
        shares = weighted_shares({1: w, 2: w, 3: 1.0, 4: 1.0}, 2.0)  # 2 bursts, 2 spinners
        assert sched_probe.weight_of(shares[1]) == pytest.approx(w)
    assert sched_probe.weight_of(0.9) == pytest.approx(9.0)
    assert sched_probe.weight_of(0.3) == 1.0  # slower than fair: never below plain sharing
    assert sched_probe.weight_of(1.0) == sched_probe.MAX_WEIGHT
    assert sched_probe.weight_of(0.99999) == sched_probe.MAX_WEIGHT


def test_the_probe_takes_the_median_beside_spinners_and_checks_the_floor(monkeypatch):
    calls = []

    def rates(cores: int, spinners: int, seconds: float = 0.0) -> list[float]:
        calls.append(spinners)
        return [0.8, 0.9, 0.95] if spinners else [0.99, 1.0, 0.98]

    monkeypatch.setattr(sched_probe, "burst_rates", rates)
    found = sched_probe.measure_reader_weight(cores=2, rounds=2)
    assert calls == [0, 2, 2, 0]  # arms alternate, order rotated per round
    assert found.rate == pytest.approx(0.9) and found.weight == pytest.approx(9.0)
    assert found.alone_rate == pytest.approx(0.99) and found.bursts == 6
    # a machine so busy the bursts alone run slow: nothing to tell, no weight
    monkeypatch.setattr(sched_probe, "burst_rates",
                        lambda cores, spinners, seconds=0.0: [0.5, 0.6])
    assert sched_probe.measure_reader_weight(cores=2, rounds=1) is None


def test_reader_weight_round_trips_the_profile(tmp_path):
    from profile_helpers import assert_profile_round_trip

    assert_profile_round_trip(tmp_path, "reader_cpu_weight", 447.0,
                              {"reader_weight_how": "2 processes every 1.5 ms"}, 0.5,
                              "reader_cpu_weight.*must be >= 1")


def test_weighted_readers_are_served_first_in_a_whole_run():
    """Two cores shared by the main thread, a CPU backend's compute thread and two readers
    prefetching the layer lead's experts (0.3 ms of CPU each, a fast device): weighting the
    readers serves their reads first, so they finish sooner and the main and compute threads
    wait for cores instead: decode is slower for the same work."""
    import polars as pl

    m = model(layers=6, experts=64, k=4, build_ms_per_layer=0.3, consumer_first=1,
              consumer_last=5, heads=5, head_bytes=0)
    runs = {}
    for w in (1.0, 1000.0):
        hw = hardware(cpu_cores=2, compute_on_cpu=True, cold_overhead_ms=0.3,
                      ssd_latency_ms=0.05, ssd_bandwidth_gbps=50.0, mem_bandwidth_gbps=2.0,
                      reader_cpu_weight=w)
        sc = scenario(hw=hw, m=m, path="staged", lead="layer", readers=2, decode_steps=60,
                      lookahead=True, o_direct=True)
        runs[w] = run_scenario(sc, routing=to_input(uniform_routing(60, 6, 64, 4, seed=3)))
    plain, weighted = runs[1.0], runs[1000.0]
    assert plain.figures.cpu_contended_fraction > 0.1  # readers do run beside the others
    assert weighted.metrics["decode_tok_s"] < 0.97 * plain.metrics["decode_tok_s"]

    def read_ms(run) -> float:
        loads = run.trace.loads.filter(pl.col("thread").str.starts_with("reader"))
        return ((loads["finished_ns"] - loads["started_ns"]) / 1e6).median()

    assert read_ms(weighted) < 0.95 * read_ms(plain)
    assert weighted.figures.cpu_seconds_by_thread["compute"] == pytest.approx(
        plain.figures.cpu_seconds_by_thread["compute"])  # the same compute, served later
