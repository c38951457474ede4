"""Measurements turned into profile values (calibration.profile_values), by hand and in closed
form: the storage fit recovers the costs it was built from, simulated loads cost what the engine
measured, the device's speedup curve, reads per bundle, the written profile round-trips, and the
probes' curves survive the trip."""

from __future__ import annotations

import pytest
from profile_helpers import MACHINE, compute, storage
from sim_helpers import hardware, model, routing_input, scenario, uniform_routing

from calibration.profile_values import (
    compute_values,
    expert_rate_gbps,
    glu_fit,
    hardware_toml,
    hardware_values,
    linear_fit,
    storage_values,
    write_hardware,
)
from sim.profiles import load_hardware
from sim.replay import run_scenario


def test_linear_fit_is_exact_on_a_line():
    a, b = linear_fit([1, 2, 4, 8], [0.1 + 0.2 * x for x in (1, 2, 4, 8)])
    assert a == pytest.approx(0.1) and b == pytest.approx(0.2)


def test_storage_fit_recovers_the_costs_it_was_built_from():
    v = storage_values(storage())
    assert v["memcpy_gbps"][0] == pytest.approx(8.0, rel=1e-3)
    assert v["ssd_bandwidth_gbps"][0] == pytest.approx(1.5, rel=1e-3)
    assert v["ssd_latency_ms"][0] == pytest.approx(0.05)
    assert v["queue_depth"][0] == 2  # 1.3 GB/s is within 90% of the best 1.36
    # no engine bundle figures: per-range intercepts x 9 ranges
    assert v["load_overhead_ms"][0] == pytest.approx(9 * 0.004, abs=1e-4)
    assert v["cold_overhead_ms"][0] == pytest.approx(9 * (0.09 - 0.004) - 0.05, abs=1e-4)


def test_simulated_loads_cost_what_the_engine_measured():
    """With engine bundle reads, the sim's warm and cold load of that bundle (QD1, main thread)
    take exactly the measured times: the bundle's 9 ranges are 9 device requests, as the
    engine's store reads them."""
    c = compute()
    values = hardware_values(storage(), c, MACHINE, active_params=1e6)
    hw = load_hardware_from(values)
    assert values["cold_overhead_ms"][0] == pytest.approx(
        0.9 - 0.08 - (9 * 0.05 + 100_000 / 1.5e9 * 1e3), abs=1e-4)
    m = model(layers=1, experts=16, k=1, bundle_bytes=c.bundle_bytes, build_ms_per_layer=0.0,
              bundle_reads=9)
    # every step routes expert 0 then 1 alternately: 2 cold loads, then warm ones (page cache)
    routing = routing_input(uniform_routing(40, 1, 2, 1, seed=1))
    sc = scenario(hw=hw, m=m, path="hot", lru_bytes=c.bundle_bytes, readers=0, decode_steps=40)
    loads = run_scenario(sc, routing=routing).trace.loads
    ms = ((loads["finished_ns"] - loads["started_ns"]) / 1e6).to_list()
    cold = [t for t, is_cold in zip(ms, loads["cold"].to_list(), strict=True) if is_cold]
    warm = [t for t, is_cold in zip(ms, loads["cold"].to_list(), strict=True) if not is_cold]
    assert cold and warm
    assert all(t == pytest.approx(c.cold_bundle_ms, abs=1e-4) for t in cold)  # 4-decimal profile
    assert all(t == pytest.approx(c.warm_bundle_ms, abs=1e-4) for t in warm)


def test_fits_use_the_measured_models_reads_per_bundle():
    """A model whose bundle is 3 slices (not the bundled layout's 1): the warm load's fixed
    cost is 3 pread intercepts."""
    st = storage()
    c = compute(cold_read_cpu_ms=0.45, cold_read_wall_ms=0.9, gil_handoff_ms=0.01,
                bundle_reads=3)
    c.warm_bundle_ms = float("nan")  # the per-size fit x reads per bundle sets load_overhead
    values = hardware_values(st, c, MACHINE, active_params=1e6)
    assert values["load_overhead_ms"][0] == pytest.approx(3 * 0.004, rel=1e-3)
    c.bundle_reads = 1
    one = hardware_values(st, c, MACHINE, active_params=1e6)
    assert one["load_overhead_ms"][0] == pytest.approx(0.004, rel=1e-3)


def load_hardware_from(values):
    from sim.profiles import hardware_from_values

    return hardware_from_values("cal", values)


def test_written_profile_loads_and_round_trips(tmp_path):
    values = hardware_values(storage(), compute(), MACHINE, active_params=2e6)
    text = hardware_toml(values, "cal", "2026-01-01 00:00 UTC", "ssdmoe calibrate --out x")
    path = write_hardware(tmp_path / "cal.toml", text)
    hw = load_hardware(str(path))
    for key, (value, how) in values.items():
        assert getattr(hw, key) == pytest.approx(value), key
        assert how  # every value says how it was measured
    lines = [ln for ln in path.read_text().splitlines() if " = " in ln and
             not ln.startswith(("#", "description"))]
    assert len(lines) == len(values) and all("  # " in ln for ln in lines)
    # compute: expert time = e0 + K x bundle / expert_gbps reproduces the glu fit
    c = compute()
    e_ms = lambda k: hw.expert_overhead_ms + k * c.bundle_bytes / (hw.expert_gbps * 1e9) * 1e3  # noqa: E731
    assert e_ms(1) == pytest.approx(0.3, abs=0.02) and e_ms(8) == pytest.approx(1.7, abs=0.02)
    assert c.resident_bytes / (hw.mem_bandwidth_gbps * 1e9) * 1e3 == pytest.approx(4.0)
    assert hw.sync_overhead_ms == pytest.approx(0.25) and hw.lazy_compute is True
    assert hw.compute_tflops == pytest.approx(2 * 2e6 * 64 / 0.1 / 1e12)
    assert hw.handoff_ms == pytest.approx(0.04)  # the measured median round trip


def test_unmeasured_handoff_is_left_out_of_the_profile():
    values = hardware_values(storage(), compute(handoff_ms=float("nan")), MACHINE,
                             active_params=2e6)
    assert "handoff_ms" not in values
    assert "reader_wake_ms" not in values  # compute() measured no wake-up either
    values = hardware_values(storage(), compute(reader_wake_ms=0.03, reader_wake_p10_ms=0.02),
                             MACHINE, active_params=2e6)
    assert values["reader_wake_ms"][0] == pytest.approx(0.03)
    assert "gil_handoff_ms" not in values
    values = hardware_values(storage(), compute(gil_handoff_ms=0.02, gil_handoff_p90_ms=0.09,
                                                gil_handoff_reps=40), MACHINE, active_params=2e6)
    assert values["gil_handoff_ms"][0] == pytest.approx(0.02)
    assert "cold_read_cpu_ms" not in values
    values = hardware_values(storage(), compute(cold_read_cpu_ms=0.42, cold_read_wall_ms=0.84,
                                                cold_read_reps=80), MACHINE, active_params=2e6)
    assert values["cold_read_cpu_ms"][0] == pytest.approx(0.42)
    assert "cold_read_cpu_us_per_page" not in values


def test_cold_read_cpu_splits_into_per_request_and_per_page():
    """cold_page_cpu read 15 pages in 0.05 ms and 240 in 0.275 ms: 1 us a page by hand. The
    store's cold bundle read (0.42 ms, 15 pages) less its pages at that rate is the per-request
    part: 0.405 ms. Three sizes off a line take the least-squares slope: (10, 0.02), (20, 0.05),
    (40, 0.08) have mean pages 23.33, mean 0.05 ms, sum of products 0.9 over squares 466.67:
    1.9286 us a page (the end points alone say 2), and 0.42 - 10 x 0.0019286 = 0.40071 ms per
    request. A negative slope (noise) or one size leaves the per-bundle figure as it was."""
    def values(points):
        return hardware_values(storage(), compute(cold_read_cpu_ms=0.42, cold_read_wall_ms=0.84,
                                                  cold_read_reps=80, cold_page_cpu=points),
                               MACHINE, active_params=2e6)

    two = values([(15, 0.05), (240, 0.275)])
    assert two["cold_read_cpu_us_per_page"][0] == pytest.approx(1.0)
    assert two["cold_read_cpu_ms"][0] == pytest.approx(0.405)
    three = values([(10, 0.02), (20, 0.05), (40, 0.08)])
    assert three["cold_read_cpu_us_per_page"][0] == pytest.approx(1.9286, abs=1e-4)
    assert three["cold_read_cpu_ms"][0] == pytest.approx(0.40071, abs=1e-4)
    for noise in ([(15, 0.3), (240, 0.2)], [(15, 0.05)], []):
        flat = values(noise)
        assert "cold_read_cpu_us_per_page" not in flat
        assert flat["cold_read_cpu_ms"][0] == pytest.approx(0.42)


def test_a_profile_without_the_new_keys_still_loads(tmp_path):
    values = hardware_values(storage(), compute(), MACHINE, active_params=2e6)
    for key in ("expert_gbps", "expert_overhead_ms", "sync_overhead_ms", "lazy_compute",
                "handoff_ms"):
        values.pop(key)
    path = write_hardware(tmp_path / "old.toml", hardware_toml(values, "old", "t", "c"))
    hw = load_hardware(str(path))
    assert (hw.expert_gbps, hw.expert_overhead_ms, hw.sync_overhead_ms, hw.lazy_compute,
            hw.handoff_ms) == (0.0, 0.0, 0.0, False, 0.0)


def test_lazy_compute_closed_form():
    """Lazy compute, free loads: a decode step = L x (build + attention + experts) + (L + 1)
    syncs (one per router, one at the end), each sync_overhead_ms."""
    L, b, s = 3, 0.5, 0.2
    hw = hardware(lazy_compute=True, sync_overhead_ms=s, ssd_latency_ms=0.0,
                  ssd_bandwidth_gbps=1e9, mem_bandwidth_gbps=1.0, expert_gbps=0.5,
                  expert_overhead_ms=0.1)
    m = model(layers=L, experts=16, k=2, bundle_bytes=100_000, resident_bytes=3_000_000,
              build_ms_per_layer=b)
    attn = 3_000_000 / L / 1e9 * 1e3
    expert = 0.1 + 2 * 100_000 / 0.5e9 * 1e3
    want = L * (b + attn + expert) + (L + 1) * s
    sc = scenario(hw=hw, m=m, path="staged", decode_steps=20)
    result = run_scenario(sc, routing=routing_input(uniform_routing(20, L, 16, 2, seed=2)))
    assert result.metrics["step_ms_p50"] == pytest.approx(want, abs=2e-6)
    eager = run_scenario(scenario(hw=hardware(sync_overhead_ms=0.0, ssd_latency_ms=0.0,
                                              ssd_bandwidth_gbps=1e9, mem_bandwidth_gbps=1.0,
                                              expert_gbps=0.5, expert_overhead_ms=0.1),
                                  m=m, path="staged", decode_steps=20),
                         routing=routing_input(uniform_routing(20, L, 16, 2, seed=2)))
    # eager: each layer's build overlaps the previous layer's experts
    assert eager.metrics["step_ms_p50"] == pytest.approx(want - (L + 1) * s - (L - 1) * b,
                                                         abs=2e-6)


def test_an_older_profile_with_retired_corrections_still_loads(tmp_path):
    """The scheduler corrections retired from the simulator (sim.scenario.RETIRED) are ignored
    where an older profile still has them; a key that never existed is refused."""
    from contract.errors import BadInput
    from sim.profiles import load_hardware

    text = hardware_toml(hardware_values(storage(), compute(), MACHINE, active_params=1e6),
                         "old", "then", "t")
    path = tmp_path / "old.toml"
    path.write_text(text + "core_wait_ms = 0.06\nidle_slowdown = [0.3, 0.0]\n")
    assert load_hardware(str(path)).name == "old"
    path.write_text(text + "core_waits_ms = 0.06\n")
    with pytest.raises(BadInput, match="core_waits_ms: unknown key"):
        load_hardware(str(path))



def test_expert_rate_from_the_swiglu_against_k():
    """0.05 ms a call + 0.1 ms an expert, at K = 1, 2, 4, 8: the fit gives both back, and a
    61,440-byte bundle over 0.1 ms is 0.6144 GB/s; compute_values writes the same figure."""
    glu = {1: 0.15, 2: 0.25, 4: 0.45, 8: 0.85}
    assert glu_fit(glu) == pytest.approx((0.05, 0.1))
    assert expert_rate_gbps(glu, 61440) == pytest.approx(0.6144)
    values = compute_values(compute(glu_ms=glu, bundle_bytes=61440))
    assert values["expert_gbps"][0] == pytest.approx(0.6144)


def test_the_compute_figures_are_the_compute_threads_cpu_where_it_was_measured():
    """With the compute thread's CPU measured, the expert figures are its SwiGLU CPU (0.02 ms a
    call + 0.08 an expert: 100,000 bytes over 0.08 ms is 1.25 GB/s) and the non-expert rate is
    the resident bytes over its CPU plus the resident step's wait for dispatch per layer (2.0 +
    4 x 0.25 = 3.0 ms: 2,000,000 / 3 ms = 0.6667 GB/s), not the probes' wall time, which holds
    their own waits (non_moe 4.0 ms: 0.5 GB/s; the wall SwiGLU 0.1 + 0.2 an expert: 0.5
    GB/s). Without any of the three CPU figures, the wall figures as before."""
    cpu_glu = {1: 0.1, 2: 0.18, 4: 0.34, 8: 0.66}
    measured = dict(glu_cpu_ms=cpu_glu, non_moe_cpu_ms=2.0, compute_wait_ms_per_layer=0.25)
    v = compute_values(compute(**measured))
    assert v["expert_gbps"][0] == pytest.approx(1.25)
    assert v["expert_overhead_ms"][0] == pytest.approx(0.02)
    assert v["mem_bandwidth_gbps"][0] == pytest.approx(2_000_000 / 3e-3 / 1e9, abs=1e-4)
    assert "compute thread's CPU" in v["mem_bandwidth_gbps"][1]
    for missing in measured:
        wall = compute_values(compute(**{k: x for k, x in measured.items() if k != missing}))
        assert wall["mem_bandwidth_gbps"][0] == pytest.approx(0.5)
        assert wall["expert_gbps"][0] == pytest.approx(0.5)
        assert wall["expert_overhead_ms"][0] == pytest.approx(0.1)
