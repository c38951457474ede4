"""sim.read_overlap: the device's concurrent-read speedup fitted from concurrent bundle reads."""

from __future__ import annotations

import pytest

from sim.profiles import load_hardware, load_model
from sim.read_overlap import extend, fit_speedup, simulated_read_ms
from tests.sim_helpers import hardware

LATENCY_MS = 0.5


def latency_only():
    """A read is one request of pure latency: no transfer time worth counting, no CPU."""
    return hardware(ssd_latency_ms=LATENCY_MS, ssd_bandwidth_gbps=1e6, queue_depth=8,
                    cpu_cores=4)


def test_reads_of_pure_latency_share_the_device_by_its_speedup():
    """Closed form: n identical reads in flight, each served at speedup(n) / n of the rate of
    one alone, all take n x latency / speedup(n)."""
    hw = latency_only()
    assert simulated_read_ms(hw, [1.0], 1, 4096, 1) == pytest.approx(LATENCY_MS, rel=1e-3)
    for curve, n in (([1.0, 1.25], 2), ([1.0, 1.25, 1.5], 3), ([1.0, 2.0], 2)):
        expect = n * LATENCY_MS / curve[n - 1]
        assert simulated_read_ms(hw, curve, n, 4096, 1) == pytest.approx(expect, rel=1e-3)


def test_the_fit_inverts_the_closed_form():
    """Measured ratios r(n) of a read at n threads over one alone give speedup n / r(n):
    1.6 at two threads -> 1.25, 2.0 at three -> 1.5; reads that overlap fully (ratio 1) get
    n, reads slower together than one after another (ratio > n) get the last count's."""
    hw = latency_only()
    curve = fit_speedup(hw, {1: 0.8, 2: 1.28, 3: 1.6}, 4096, 1)
    assert curve == pytest.approx([1.0, 1.25, 1.5], rel=2e-3)
    assert fit_speedup(hw, {1: 0.8, 2: 0.8, 3: 0.8}, 4096, 1) == [1.0, 2.0, 3.0]
    assert fit_speedup(hw, {1: 0.8, 2: 2.0, 3: 1.6}, 4096, 1) == [1.0, 1.0, 1.5]
    # counts stop at the first one missing
    assert len(fit_speedup(hw, {1: 0.8, 2: 1.28, 4: 2.0}, 4096, 1)) == 2
    with pytest.raises(ValueError, match="alone"):
        fit_speedup(hw, {2: 1.0}, 4096, 1)


def test_the_fit_recovers_a_curve_through_cpu_and_the_gil():
    """On this machine's profile (a read's CPU on two cores, its Python under the GIL, nine
    slices per bundle), walls simulated with a known curve fit back to that curve. The read's
    device and CPU figures are pinned (the 2026-12-04 01:24 calibration's): with a read's CPU
    much above half its wall, four reads on two cores take as long whatever the device's
    overlap past ~1.8, and no fit could tell the curve there."""
    hw = load_hardware("this-machine", {"cold_read_cpu_ms": 0.5165, "ssd_latency_ms": 0.0636,
                                        "ssd_bandwidth_gbps": 1.77, "cold_overhead_ms": 0.1207})
    m = load_model("tiny-trained")
    reads = 9  # the stacked layout's nine slices a bundle (pinned: the profile's is now 1)
    known = [1.0, 1.3, 1.55, 1.8]
    alone = simulated_read_ms(hw, known[:1], 1, m.bundle_bytes, reads)
    walls = {n: simulated_read_ms(hw, known[:n], n, m.bundle_bytes, reads) / alone
             for n in range(1, 5)}
    assert walls[2] > 1.1 and walls[4] > walls[3] > walls[2]  # the curve matters here
    assert fit_speedup(hw, walls, m.bundle_bytes, reads) == pytest.approx(known, rel=0.01)


def test_extend_follows_the_probe_shape_past_the_fit():
    """Past the counts fitted, the curve grows as the O_DIRECT probe's does from the same count
    (2.0 x 3.0 / 2.4 = 2.5), never above n nor below the count before (a probe that dips),
    and stays flat past the probe's end."""
    assert extend([1.0, 1.4, 2.0], [1.0, 1.6, 2.4, 3.0], 5) == [1.0, 1.4, 2.0, 2.5, 2.5]
    assert extend([1.0, 1.4, 2.0], [1.0, 1.6, 2.4, 3.0, 1.2, 3.6], 6) == [1.0, 1.4, 2.0, 2.5,
                                                                          2.5, 3.0]
    assert extend([1.0, 1.9, 2.9], [1.0, 2.0, 3.0, 4.4], 4) == [1.0, 1.9, 2.9, 4.0]
    assert extend([1.0, 1.4], [], 3) == [1.0, 1.4, 1.4]
