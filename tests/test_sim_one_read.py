"""The simulator follows the bundled layout: a profile derived from a bundled manifest reads a
bundle as one request of its pages (bundle_reads 1, no shared pages), a whole layer as one
vectored read, and a cold load then costs one device latency plus its bytes at the device's
bandwidth: the closed form, against nine latencies for the stacked layout's nine slices."""

from __future__ import annotations

import simpy
from sim_helpers import hardware

from sim.cpu import Cores
from sim.gil import Gil
from sim.loads import Fetcher, Load
from sim.model_profile import (
    PAGE,
    layout_of,
    paged_bundle_bytes,
    read_manifest_json,
    reads_per_load,
    shared_page_slices,
)
from sim.page_cache import PageCache
from sim.storage import Device


def test_bundled_manifest_gives_one_read_per_bundle(tiny_random_converted, tiny_random_stacked):
    bundled = read_manifest_json(tiny_random_converted)
    stacked = read_manifest_json(tiny_random_stacked)
    assert (layout_of(bundled), layout_of(stacked)) == ("bundled", "stacked")
    assert reads_per_load(bundled) == (1, 1)  # 32 bundles x 10 iovecs fit one IOV_MAX read
    assert reads_per_load(bundled, iov_max=19) == (1, 17)  # ceil(320 / 19)
    assert reads_per_load(stacked) == (9, 9)
    assert shared_page_slices(bundled) == (0, 1)
    bundle = int(bundled["bundle_bytes"])
    assert paged_bundle_bytes(bundled) == -(-bundle // PAGE) * PAGE  # one aligned span


def _cold_load_ms(bundle_reads: int, latency_s: float, bandwidth: float, paged: int) -> float:
    env = simpy.Environment()
    hw = hardware(load_overhead_ms=0.0, cold_overhead_ms=0.0, memcpy_gbps=0.0, readahead=False)
    pc = PageCache(4 * paged, paged, 8)
    f = Fetcher(env, hw, Device(latency_s, bandwidth), pc, Cores(env, 0), 8, paged, paged,
                gil=Gil(env, True), bundle_reads=bundle_reads)
    load = Load(0, 0, 3, 3, paged, 1, "demand", env.now, env.event())
    env.process(f.perform(load, "main"))
    env.run()
    assert load.cold
    return (load.finished - load.started) * 1e3


def test_a_cold_bundle_is_one_request_of_its_bytes():
    paged, latency, bandwidth = 32768, 1e-4, 32768e3  # 0.1 ms a request, 1 ms the bytes
    assert round(_cold_load_ms(1, latency, bandwidth, paged), 6) == 1.1
    # the stacked layout's nine slices: nine requests, each its latency
    assert round(_cold_load_ms(9, latency, bandwidth, paged), 6) == 1.9
