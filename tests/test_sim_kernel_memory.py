"""Two mechanisms of the kernel that make a cold read and a page cache what they are on another
machine: Linux's active/inactive page-cache lists (sim.two_list_lru), checked on hand-worked
sequences against a plain LRU, and a cold read's CPU per page (Hardware.cold_read_cpu_us_per_page,
sim.loads), checked in closed form and on one core beside compute."""

from __future__ import annotations

import pytest
import simpy
from sim_helpers import hardware, read_beside_compute

from sim.bounded_cache import BoundedCache
from sim.cpu import Cores
from sim.loads import Fetcher
from sim.page_cache import PageCache
from sim.storage import Device
from sim.two_list_lru import TwoListLRU

IO = dict(ssd_latency_ms=0.1, ssd_bandwidth_gbps=1e9, queue_depth=2, load_overhead_ms=0.0,
          memcpy_gbps=0.0, cold_overhead_ms=0.0)


def _cached(cache, reads: list[int]) -> set[int]:
    """Replay reads as the page cache does (a miss is read in: insert)."""
    for key in reads:
        if not cache.lookup(key, (0, 0)):
            cache.insert(key, (0, 0))
    return set(cache.active) | set(cache.inactive) if isinstance(cache, TwoListLRU) \
        else set(cache.items)


def test_pages_read_twice_survive_a_stream_read_once():
    """4 bundles of room; 1 and 2 read twice, then 3..7 streamed once. LRU keeps the last
    four streamed; the two lists keep 1 and 2 (active) and the last two streamed (inactive):
    each streamed bundle entered inactive and was reclaimed from its tail first."""
    reads = [1, 2, 1, 2, 3, 4, 5, 6, 7]
    assert _cached(BoundedCache(4, 1), reads) == {4, 5, 6, 7}
    two = TwoListLRU(4, 1)
    assert _cached(two, reads) == {1, 2, 6, 7}
    assert list(two.active) == [1, 2] and list(two.inactive) == [6, 7]
    assert two.evictions == 3


def test_a_low_inactive_list_takes_the_active_tail_first():
    """1, 2, 3 read twice (active), 4 read in (inactive), then 5: five for four places. The
    inactive list (2) is smaller than the active one (3): the active tail (1) moves to the
    inactive head, then the inactive tail (4) is reclaimed."""
    two = TwoListLRU(4, 1)
    _cached(two, [1, 2, 3, 1, 2, 3, 4, 5])
    assert list(two.active) == [2, 3]
    assert list(two.inactive) == [5, 1]  # tail first: 5 entered before 1 was demoted


def test_a_refault_within_the_active_size_is_activated():
    """Workingset detection: 1 and 2 active; 3 and 4 read in and reclaimed (by 5, then 6);
    3, read again one reclaim after it left (at most the active list's 2), goes straight to
    active. With no active list, a page back after several reclaims is read into inactive."""
    two = TwoListLRU(4, 1)
    _cached(two, [1, 2, 1, 2, 3, 4, 5, 6])  # 3 then 4 reclaimed (stamps 1, 2)
    assert 3 not in two and 4 not in two
    _cached(two, [3])  # refault distance 2 - 1 = 1 <= 2 active
    assert 3 in two.active
    far = TwoListLRU(2, 1)
    _cached(far, [1, 2, 3, 4, 5, 6, 1])  # 1 left 5 reclaims ago; the active list is empty
    assert 1 in far.inactive


def test_the_page_cache_takes_the_hardware_policy():
    assert isinstance(PageCache(4000, 1000, 4).lru, BoundedCache)
    assert isinstance(PageCache(4000, 1000, 4, policy="linux-two-list").lru, TwoListLRU)


def _cold_read(per_page_us: float, nbytes: int, compute_ms: float = 0.0) -> tuple[float, float]:
    """One cold read of `nbytes` (0.1 ms on the device) on ONE core, beside a compute job of
    `compute_ms` from t=0; cold_read_cpu_ms 0.02 per request. (load finished, compute
    finished) in ms."""
    hw = hardware(**dict(IO, cold_read_cpu_ms=0.02, cold_read_cpu_us_per_page=per_page_us))
    return read_beside_compute(hw, nbytes, Device(0.0001, 1e15), compute_ms)


def test_a_cold_reads_cpu_grows_with_its_pages():
    """cold_read_cpu_ms + pages x cold_read_cpu_us_per_page, beside the device time:
    - 15 pages at 1 us: 0.035 ms of CPU, inside the 0.1 ms read (0.1);
    - 638 pages (a 2.6 MB bundle) at 1 us: 0.658 ms, CPU-bound: the read takes 0.658 ms;
      beside a 1 ms compute job on the one core the reading thread runs first (sim.cpu): the
      read is done at 0.658 ms, compute then runs its 1 ms (1.658);
    - without the per-page figure the per-request one alone is charged (0.1: inside the read)."""
    f = Fetcher(simpy.Environment(), hardware(**dict(IO, cold_read_cpu_ms=0.02,
                                                     cold_read_cpu_us_per_page=1.0)),
                Device(0.0001, 1e15), PageCache(1 << 20, 4096, 4), Cores(simpy.Environment(), 1),
                4, 4096)
    assert f.cold_cpu(15 * 4096, 1.0, 15 * 4096) * 1e3 == pytest.approx(0.035)
    assert f.cold_cpu(15 * 4096 + 1, 1.0, 15 * 4096) * 1e3 == pytest.approx(0.036)  # a page more
    assert _cold_read(1.0, 15 * 4096) == pytest.approx((0.1, 0.0), abs=1e-5)
    assert _cold_read(1.0, 638 * 4096) == pytest.approx((0.658, 0.0), abs=1e-5)
    assert _cold_read(1.0, 638 * 4096, 1.0) == pytest.approx((0.658, 1.658), abs=1e-5)
    assert _cold_read(0.0, 638 * 4096) == pytest.approx((0.1, 0.0), abs=1e-5)
