"""The shared device (sim.shared_device: concurrent reads overlap in part, as measured on a
virtual disk) against hand-worked timelines, against the slot model where they must agree, and
a cold bundle read as one request per range."""

from __future__ import annotations

import pytest
import simpy
from sim_helpers import hardware

from sim.cpu import Cores
from sim.loads import Fetcher, Load
from sim.page_cache import PageCache
from sim.shared_device import SharedDevice
from sim.storage import Device
from traces.schema import DEMAND


def _finish(speedup: list[float], reads: list[tuple[float, int, int]], latency: float = 1.0,
            bandwidth: float = 1e15) -> list[float]:
    """(arrival s, bytes, requests) per read -> finish times on a SharedDevice."""
    env = simpy.Environment()
    dev = SharedDevice(env, latency, bandwidth, speedup)
    out = [0.0] * len(reads)

    def one(i: int, arrival: float, nbytes: int, requests: int):
        yield env.timeout(arrival)
        _, out[i] = yield from dev.read(nbytes, requests)

    for i, r in enumerate(reads):
        env.process(one(i, *r))
    env.run()
    return out


def test_partial_overlap_by_hand():
    # speedup 1.5 at two in flight: each progresses at 0.75 -> both done at 1 / 0.75
    assert _finish([1.0, 1.5], [(0, 0, 1), (0, 0, 1)]) == pytest.approx([4 / 3, 4 / 3])
    # past the curve it stays flat: three at 1.5 / 3 = 0.5 each -> 2.0
    assert _finish([1.0, 1.5], [(0, 0, 1)] * 3) == pytest.approx([2.0] * 3)
    # a late arrival: alone for 0.5 s (half done), then both at 0.75: the first has 0.5 left
    # -> done at 0.5 + 0.5 / 0.75 = 1.1667, the second has had 0.5 by then, alone: 1.6667
    assert _finish([1.0, 1.5], [(0, 0, 1), (0.5, 0, 1)]) == pytest.approx([7 / 6, 5 / 3])
    # back-to-back requests of one thread pay one latency each; bytes share one pipe
    assert _finish([1.0], [(0, 0, 9)]) == pytest.approx([9.0])
    assert _finish([1.0, 2.0], [(0, 2, 1), (0, 2, 1)], bandwidth=1.0) == pytest.approx(
        [1.0 + 4.0, 1.0 + 4.0])


def test_linear_speedup_is_the_slot_model_with_room_for_everyone():
    # finishes in arrival order (the slot model's pipe hands transfers over in order)
    reads = [(0.0, 0, 1), (0.2, 0, 2), (0.3, 0, 3), (1.5, 0, 1)]
    shared = _finish([1.0, 2.0, 3.0, 4.0], reads, latency=0.5)
    slots = Device(0.5, 1e15, queue_depth=4)
    assert shared == pytest.approx([slots.read(a, b, r)[1] for a, b, r in reads])


def test_a_curve_must_start_at_one():
    with pytest.raises(ValueError):
        SharedDevice(simpy.Environment(), 0.1, 1e9, [2.0, 3.0])


@pytest.mark.parametrize("shared", [False, True])
def test_a_cold_bundle_is_one_request_per_range(shared):
    """9 ranges, no readahead: 9 latencies + the bytes on an idle device (no CPU costs)."""
    env = simpy.Environment()
    hw = hardware(readahead=False, ssd_latency_ms=0.05, ssd_bandwidth_gbps=1.0,
                  load_overhead_ms=0.0, cold_overhead_ms=0.0, memcpy_gbps=0.0)
    device = SharedDevice(env, 0.05e-3, 1e9, [1.0]) if shared else Device(0.05e-3, 1e9)
    pc = PageCache(1 << 30, 60_000, 16)
    f = Fetcher(env, hw, device, pc, Cores(env, 0), 16, 60_000, bundle_reads=9)
    load = Load(0, 0, 3, 3, 60_000, 1, DEMAND, 0.0, env.event())
    env.process(f.perform(load, "main"))
    env.run()
    assert load.cold and load.finished == pytest.approx(9 * 0.05e-3 + 60_000 / 1e9)
