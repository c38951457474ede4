"""Caches: LRU hit rates against the i.i.d. closed form, and the fixed-RAM trade-off between
the engine's bundle LRU and the OS page cache."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from sim_helpers import GIB, MB, hardware, model, routing_input, scenario, uniform_routing

from sim.bounded_cache import BoundedCache
from sim.replay import run_scenario


def _decode(result) -> pl.DataFrame:
    return result.trace.steps.filter(pl.col("phase") == "decode")


def test_lru_unit_behaviour():
    lru = BoundedCache(3 * 10, 10)
    for key in (1, 2, 3):
        lru.insert(key, (0, key))
    assert lru.lookup(1, (1, 0))  # 1 becomes most recent
    lru.insert(4, (1, 1))  # evicts 2, the least recent
    assert 2 not in lru and 1 in lru and 3 in lru and 4 in lru
    assert lru.evictions == 1 and lru.used_bytes == 30
    assert BoundedCache(9, 10).capacity == 0  # capacity is whole items


def _iid_hit_rate(capacity: int, lru_bundles: int, steps_n: int = 40000) -> float:
    # One layer of N = 64 experts, K = 1: each request is one uniform bundle, independent of
    # what is cached, so any full cache of c bundles hits c/N. (With two layers taking turns
    # it does not: the last request, always of the other layer, is always cached, and the
    # hit rate is about (c - 0.3)/N; a loose tolerance once hid that.)
    m = model(layers=1, experts=64, k=1)
    sc = scenario(m=m, path="hot", lru_bytes=lru_bundles * MB, decode_steps=steps_n)
    router = uniform_routing(steps_n, 1, 64, 1, seed=capacity)
    steps = _decode(run_scenario(sc, routing=routing_input(router)))
    assert int(steps["cache_evictions"].sum()) > 0
    warm = steps.filter(pl.col("step") >= 500)  # skip the cold start
    hits = warm["cache_hits"].sum()
    return hits / (hits + warm["cache_misses"].sum())


@pytest.mark.parametrize("capacity", [8, 24])
def test_bundle_lru_hits_c_over_n_under_iid_uniform_routing(capacity):
    """c/N, two-sided, with a tolerance (half of one bundle's 1/64) that one bundle of capacity
    too many or too few exceeds: checked by running those too."""
    tol = 0.5 / 64
    assert _iid_hit_rate(capacity, capacity) == pytest.approx(capacity / 64, abs=tol)
    for off in (-1, 1):  # the same routing with a bundle more or less misses the closed form
        assert _iid_hit_rate(capacity, capacity + off) != pytest.approx(capacity / 64, abs=tol)


@pytest.mark.parametrize("sequence,hits", [
    # capacity 2, hand-worked:      LRU  FIFO  LFU
    ([0, 1, 0, 2, 0, 1], 2),       # 2    1     2   (FIFO evicts 0, just reused, for 2)
    ([0, 0, 1, 2, 1, 2, 0], 3),    # 3    3     2   (LFU keeps 0, used twice, and thrashes)
])
def test_replacement_is_lru_not_fifo_or_lfu(sequence, hits):
    """A trace with reuse whose hit counts differ by policy (worked out by hand above): the
    simulated bundle LRU gives exactly the LRU count."""
    m = model(layers=1, experts=8, k=1)
    sc = scenario(m=m, path="hot", lru_bytes=2 * MB, decode_steps=len(sequence))
    router = np.array(sequence, dtype=np.int16).reshape(-1, 1, 1)
    steps = _decode(run_scenario(sc, routing=routing_input(router)))
    assert int(steps["cache_hits"].sum()) == hits


@pytest.mark.parametrize("sequence,hits,demand_steps", [
    # 3 slots (K=1 + headroom 2), hand-worked:        LRU  FIFO
    ([0, 1, 2, 0, 3, 0, 1], [0, 0, 0, 1, 0, 1, 0], [0, 1, 2, 4, 6]),  # 2  1 (FIFO drops 0 for 3)
    ([0, 1, 2, 3, 1, 0], [0, 0, 0, 0, 1, 0], [0, 1, 2, 3, 5]),  # 1  1 (both drop 0 for 3)
])
def test_staged_slots_replace_the_least_recently_used(sequence, hits, demand_steps):
    """The staged path's per-layer slot table (engine.paths.slot_table): a routed expert that
    is held is a hit; a missing one is read into the least recently used slot. The first
    sequence tells LRU from FIFO (worked out by hand above); no bundle LRU behind the slots."""
    m = model(layers=1, experts=8, k=1)
    sc = scenario(m=m, path="staged", staged_headroom=2, lru_bytes=0,
                  decode_steps=len(sequence))
    router = np.array(sequence, dtype=np.int16).reshape(-1, 1, 1)
    result = run_scenario(sc, routing=routing_input(router))
    steps = _decode(result)
    assert steps["cache_hits"].to_list() == hits
    demand = result.trace.loads.filter(pl.col("source") == "demand")
    assert sorted(demand["step"].to_list()) == demand_steps


def test_page_cache_hit_rate_closed_form_and_capacity_is_ram_minus_unreclaimable():
    # 1 layer x 64 experts, K=1. RAM 1 GiB - OS reserve 0.5 GiB - resident (0.5 GiB - 17 MiB)
    # - the layer's one staged slot (1 MiB: headroom 0) = a page cache of 16 bundles.
    m = model(layers=1, experts=64, k=1, resident_bytes=int(0.5 * GIB) - 17 * MB)
    hw = hardware(ram_gib=1.0, os_reserve_gib=0.5)
    sc = scenario(hw=hw, m=m, path="staged", staged_headroom=0, decode_steps=8000)
    # The sticky slot serves a repeat of the previous expert, so draw each token uniformly
    # among the 63 experts other than the previous one.
    rng = np.random.default_rng(3)
    ids = np.empty(8000, dtype=np.int16)
    ids[0] = 0
    for t in range(1, len(ids)):
        ids[t] = (ids[t - 1] + 1 + rng.integers(63)) % 64
    result = run_scenario(sc, routing=routing_input(ids.reshape(-1, 1, 1)))
    assert result.figures.memory["page_cache"] == 16 * MB
    assert result.figures.page_cache_capacity_bytes == 16 * MB
    steps = _decode(result).filter(pl.col("step") >= 500)
    assert steps["loads"].sum() == steps.height  # every token misses the sticky slot
    warm = 1 - steps["cold_loads"].sum() / steps["loads"].sum()
    # the page cache holds the 16 most recent bundles, one of which (the previous) is never
    # asked for: an i.i.d. uniform pick among the other 63 hits 15 of them
    assert warm == pytest.approx(15 / 63, abs=0.015)


def _tok_s(ram_gib: float, lru_bundles: int, cold_ms: float) -> float:
    # 4 layers x 64 experts = 256 bundles of 1 MiB, skewed i.i.d. routing, K=2.
    m = model(layers=4, experts=64, k=2)
    hw = hardware(ram_gib=ram_gib, ssd_latency_ms=cold_ms, ssd_bandwidth_gbps=10.0,
                  load_overhead_ms=0.2)
    sc = scenario(hw=hw, m=m, path="hot", lru_bytes=lru_bundles * MB, decode_steps=3000)
    popularity = 1.0 / np.arange(1, 65) ** 0.8
    router = uniform_routing(3000, 4, 64, 2, seed=7, popularity=popularity)
    return run_scenario(sc, routing=routing_input(router)).metrics["decode_tok_s"]


def test_bigger_lru_never_loses_when_the_page_cache_is_not_starved():
    # 1 GiB of RAM: the page cache holds all 256 bundles whatever the LRU takes (<= 0.5 GiB)
    speeds = [_tok_s(1.0, c, cold_ms=5.0) for c in (8, 32, 128, 256, 512)]
    assert all(b >= a for a, b in zip(speeds, speeds[1:], strict=False)), speeds
    assert speeds[-1] > speeds[0] * 1.05


def test_bigger_lru_loses_when_it_starves_the_page_cache():
    # RAM for 200 bundles in all: every bundle the LRU pins comes out of the page cache. Reads go
    # through the page cache, so its most recent part duplicates the LRU: up to half the budget,
    # a bigger LRU shrinks what is cached at all, and a page-cache miss (5 ms) costs far more
    # than the LRU saves on a warm read (0.2 ms).
    ram = 200 * MB / GIB
    speeds = [_tok_s(ram, c, cold_ms=5.0) for c in (8, 32, 64, 96)]
    assert all(b < a for a, b in zip(speeds, speeds[1:], strict=False)), speeds
    assert speeds[-1] < 0.8 * speeds[0]
