"""Small mechanisms of the model against hand-worked figures: the main thread helping the
readers (help_reads), page-rounded reads and the edge pages a neighbour already brought in,
the engine's page-cache budget dropping pages, and oversubscribed memory faulting back in."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import simpy
from sim_helpers import MB, hardware, model, routing_input, scenario

from sim.cpu import Cores
from sim.loads import Fetcher, Load
from sim.memory_budget import budget
from sim.page_cache import PageCache
from sim.replay import run_scenario
from sim.storage import Device
from sim.swap import Swap

IO = dict(ssd_latency_ms=0.1, ssd_bandwidth_gbps=1e9, queue_depth=2, load_overhead_ms=0.05,
          cold_overhead_ms=0.0, memcpy_gbps=0.0, handoff_ms=0.0, mem_bandwidth_gbps=1e9)


def _fill_blocked(help_reads: bool):
    # 1 layer, K=2, every read cold (O_DIRECT): two misses at the layer's fill
    m = model(layers=1, experts=16, k=2, build_ms_per_layer=0.5)
    router = np.array([[[2 * (s % 4), 2 * (s % 4) + 1]] for s in range(8)], dtype=np.int16)
    sc = scenario(hw=hardware(**IO), m=m, path="hot", lru_bytes=MB, readers=1, o_direct=True,
                  decode_steps=8, help_reads=help_reads)
    res = run_scenario(sc, routing=routing_input(router))
    return res.trace.steps.filter(pl.col("phase") == "decode"), res.trace.loads


def test_the_main_thread_reads_the_first_miss_itself_and_the_reader_the_other():
    load_ns = round((0.1 + 0.05) * 1e6)  # latency + the read's CPU; bytes are free
    helped, loads = _fill_blocked(True)
    # main reads one while the reader reads the other (queue depth 2): one load's time
    assert helped["blocked_ns"].to_list() == [load_ns] * 8
    assert sorted(set(loads["thread"].to_list())) == ["main", "reader0"]
    alone, loads = _fill_blocked(False)
    # the one reader reads both, one after the other
    assert alone["blocked_ns"].to_list() == [2 * load_ns] * 8
    assert set(loads["thread"].to_list()) == {"reader0"}


def _cold_bytes(neighbours: list[int]) -> int:
    env = simpy.Environment()
    bundle, paged = 61_440, 61_440 + 8192
    pc = PageCache(16 * paged, bundle, 16)
    for e in neighbours:
        pc.fill(e, (0, 0))
    device = Device(0.0, 1e9)
    f = Fetcher(env, hardware(**IO), device, pc, Cores(env, 0), 16, bundle, paged)
    load = Load(0, 0, 5, 5, bundle, 1, "demand", 0.0, env.event())
    env.process(f.perform(load, "main"))
    env.run()
    return device.bytes_read


def test_a_cold_read_moves_its_pages_less_the_edges_a_cached_neighbour_holds():
    assert _cold_bytes([]) == 61_440 + 8192
    assert _cold_bytes([4]) == 61_440 + 4096
    assert _cold_bytes([6]) == 61_440 + 4096
    assert _cold_bytes([4, 6]) == 61_440


def _budget_evict_runs(**over) -> dict[float, tuple[pl.DataFrame, pl.DataFrame]]:
    """The last 10 decode steps and loads, with no page drop and with a 0.3 ms one: a page
    cache of one bundle and two experts alternating, so every read is cold and evicts one."""
    m = model(layers=1, experts=16, k=1, build_ms_per_layer=0.5)
    router = np.array([[[s % 2]] for s in range(20)], dtype=np.int16)
    io = dict(IO, ram_gib=64.0, os_reserve_gib=64.0 - 2 / 1024)  # 2 MiB: the LRU + 1 bundle
    runs = {}
    for evict in (0.0, 0.3):
        sc = scenario(hw=hardware(**io), m=m, path="hot", lru_bytes=MB, decode_steps=20,
                      budget_evict_ms=evict, **over)
        assert budget(sc).page_cache == MB
        res = run_scenario(sc, routing=routing_input(router))
        runs[evict] = (res.trace.steps.filter(pl.col("phase") == "decode").tail(10),
                       res.trace.loads.tail(10))
    return runs


def test_the_budget_drops_pages_on_the_main_thread_after_each_cold_read():
    runs = _budget_evict_runs()
    (steps0, _), (steps, _) = runs[0.0], runs[0.3]
    # synchronous loop: the drop is graph-building time, not time blocked on the read
    assert steps["blocked_ns"].to_list() == steps0["blocked_ns"].to_list()
    extra = (steps["build_ns"] - steps0["build_ns"]).to_list()
    assert extra == [round(0.3e6)] * 10


@pytest.mark.parametrize("evict", [0.0, 0.3])
def test_the_drops_are_the_slope_of_build_over_cold_reads(evict):
    """What validate fits the drops from (sim.compare.build_per_cold_read_ms) reads the
    modelled drop back from the simulated trace: per step experts 0 and 15 (warm) and 0, 1
    or 2 of experts 1-6 in turn (a page cache of 4 bundles: each of those is cold and evicts
    one), so the steps' cold reads vary and each adds `evict` ms of building."""
    from types import SimpleNamespace

    from sim.compare import build_per_cold_read_ms

    m = model(layers=1, experts=16, k=4, build_ms_per_layer=0.5)
    cycle = [[1, 2], [3], [], [4, 5], [6], []]
    rows = [[[0, 15] + cycle[s % 6] + [15] * (2 - len(cycle[s % 6]))] for s in range(30)]
    router = np.array(rows, dtype=np.int16)
    io = dict(IO, ram_gib=64.0, os_reserve_gib=64.0 - 5 / 1024)  # the LRU + 4 bundles
    sc = scenario(hw=hardware(**io), m=m, path="hot", lru_bytes=MB, decode_steps=30,
                  budget_evict_ms=evict)
    assert budget(sc).page_cache == 4 * MB
    res = run_scenario(sc, routing=routing_input(router))
    # the last 12 steps: by then the page cache is full and every cold read evicts one (the
    # first ones fill it and evict nothing)
    decode = res.trace.steps.filter(pl.col("phase") == "decode").tail(12)
    assert sorted(set(decode["cold_loads"].to_list())) == [0, 1, 2]
    assert build_per_cold_read_ms(SimpleNamespace(steps=decode)) == pytest.approx(evict,
                                                                                   abs=1e-9)


@pytest.mark.parametrize("help_reads", [False, True])
def test_a_wait_on_a_pooled_read_lasts_through_the_budgets_page_drops(help_reads):
    """With a reader pool the engine sets a load's event only once read_bundle returns, and the
    budget drops the evicted pages inside it (engine.page_cache_budget.charge): the main thread
    waits through the drops, whether a reader (help_reads off) or the main thread itself (on:
    it keeps the one miss) did the read. Hand-worked: every read is cold and evicts one
    bundle, so each step's blocked time grows by exactly the drop and its build not at all."""
    runs = _budget_evict_runs(readers=1, help_reads=help_reads)
    (steps0, loads0), (steps, loads) = runs[0.0], runs[0.3]
    assert set(loads["thread"]) == {"main" if help_reads else "reader0"}
    assert loads["cold"].all()
    extra = (steps["blocked_ns"] - steps0["blocked_ns"]).to_list()
    assert extra == [round(0.3e6)] * 10
    assert steps["build_ns"].to_list() == steps0["build_ns"].to_list()
    # the load row ends with the read, before the drops (the store's finished_ns)
    took = lambda t: (t["finished_ns"] - t["started_ns"]).to_list()  # noqa: E731
    assert took(loads) == took(loads0)


def _read_beside_a_build(gil_on: bool, native: bool = False) -> tuple[dict[str, float], Load]:
    """A reader's cold read (0.2 ms on the device, 0.05 ms of Python) that evicts one bundle,
    whose pages take 0.3 ms to drop, while the main thread asks for the GIL at 0.3 ms to build
    for 1 ms: when the read finished, its load was done and the build ended (ms)."""
    from sim.gil import Gil

    env = simpy.Environment()
    cores = Cores(env, 0)
    gil = Gil(env, gil_on)
    pc = PageCache(1000, 1000, 16)  # room for one bundle: holds expert 5
    pc.fill(5, (0, 0))
    f = Fetcher(env, hardware(**IO), Device(0.0002, 1e12), pc, cores, 16, 1000,
                evict_ms=0.3, gil=gil, native_reads=native)
    load = Load(0, 0, 3, 3, 1000, 1, "prefetch", 0.0, env.event())
    seen: dict[str, float] = {}

    def main():
        yield env.timeout(0.0003)
        yield from gil.run(cores, 0.001, "main")
        seen["build_end"] = env.now

    def waiter():
        yield load.done
        seen["done"] = env.now

    env.process(f.perform(load, "reader0"))
    env.process(main())
    env.process(waiter())
    env.run()
    seen["finished"] = load.finished
    return {k: v * 1e3 for k, v in seen.items()}, load


def test_the_budgets_page_drops_hold_the_gil():
    """Each fadvise returns before a waiting thread could take the GIL, so the drops keep it:
    the read and its Python end at 0.25 ms, the main thread gets the GIL when the drops end, at
    0.55 ms, and the load is done then too."""
    held, _ = _read_beside_a_build(True)
    assert held["finished"] == pytest.approx(0.2 + 0.05, abs=1e-5)  # the read, its Python
    assert held["done"] == pytest.approx(0.25 + 0.3, abs=1e-5)
    assert held["build_end"] == pytest.approx(0.55 + 1.0, abs=1e-5)
    free, _ = _read_beside_a_build(False)
    assert free["build_end"] == pytest.approx(0.3 + 1.0, abs=1e-5)  # no lock: at once


def test_a_native_readers_load_takes_no_gil_and_owes_its_row_to_the_main_thread():
    """The same read on a native reader (engine.native_reads): no Python runs on the reader,
    so the read ends at 0.2 ms and the native thread drops the victim's pages without the GIL
    (done at 0.5 ms); the main thread builds from 0.3 ms without waiting for anything (1.3 ms),
    and the read's Python (0.05 ms) is owed to it, paid holding the GIL when it collects the
    load."""
    seen, load = _read_beside_a_build(True, native=True)
    assert seen["finished"] == pytest.approx(0.2, abs=1e-6)
    assert seen["done"] == pytest.approx(0.2 + 0.3, abs=1e-6)
    assert seen["build_end"] == pytest.approx(0.3 + 1.0, abs=1e-6)
    assert load.owed * 1e3 == pytest.approx(0.05, abs=1e-6)


def test_a_native_loads_owed_row_is_main_thread_time_at_collection():
    """sim.main_thread.MainThread.wait on a finished native load pays what it owes, holding
    the GIL: the scenario with native readers builds each step longer by the rows' Python,
    where Python readers pay it on their own threads."""
    runs = {}
    for native in (False, True):
        m = model(layers=1, experts=16, k=2, build_ms_per_layer=0.5)
        router = np.array([[[2 * (s % 4), 2 * (s % 4) + 1]] for s in range(8)], dtype=np.int16)
        sc = scenario(hw=hardware(**IO), m=m, path="hot", lru_bytes=MB, readers=1,
                      o_direct=True, decode_steps=8, help_reads=False, gil=True,
                      native_reads=native)
        runs[native] = run_scenario(sc, routing=routing_input(router)).trace
    py, nat = runs[False], runs[True]
    assert set(py.loads["thread"]) == set(nat.loads["thread"]) == {"reader0"}
    # each decode step's two loads: 2 x 0.05 ms of Python, on the main thread when native
    steps = [t.steps.filter(pl.col("phase") == "decode") for t in (py, nat)]
    diff = (steps[1]["main_cpu_ns"] - steps[0]["main_cpu_ns"]).to_list()
    assert diff == [round(2 * 0.05e6)] * 8


def test_oversubscribed_memory_faults_its_swapped_share_back_in():
    device = Device(0.0, 1e9)
    swap = Swap(0.25, device, fault_s=0.001, layer_touch_bytes=4_000_000)
    costs = [swap.hit_cost(0.01 * i, 1_000_000) for i in range(8)]  # device idle each time
    # every fourth app-cache hit faults: 1 MB at 1 GB/s + the fault work
    assert costs == [0, 0, 0, pytest.approx(0.002)] * 2
    assert swap.layer_fault_s(1.0) == pytest.approx(1e6 / 1e9 + 0.001)  # 1/4 of 4 MB
    assert Swap(0.0, device, 0.001, 4_000_000).layer_fault_s(2.0) == 0.0
    assert device.bytes_read == 3_000_000


@pytest.mark.parametrize("path", ["exact", "hot"])
def test_the_exact_path_waits_for_its_zeroed_stack(path):
    """engine.paths.exact allocates a zeroed stack for each call's distinct experts and
    evaluates it (alloc_stack) before reading into it: per step 2 layers x K=2 x 1 MiB at
    1 GB/s is 2 x 2 x 1.048576 ms more graph building on the exact path, and nothing on the hot
    path (its pool is allocated once). Routing repeats, so nothing else differs."""
    m = model(layers=2, experts=16, k=2, build_ms_per_layer=0.5)
    router = np.array([[[0, 1], [2, 3]]] * 6, dtype=np.int16)

    def steps(fill: float) -> pl.DataFrame:
        sc = scenario(hw=hardware(**IO, zero_fill_gbps=fill), m=m, path=path,
                      lru_bytes=8 * MB if path == "hot" else 0, decode_steps=6)
        res = run_scenario(sc, routing=routing_input(router))
        return res.trace.steps.filter(pl.col("phase") == "decode")

    without, with_fill = steps(0.0), steps(1.0)
    assert with_fill["blocked_ns"].to_list() == without["blocked_ns"].to_list()
    extra = (with_fill["build_ns"] - without["build_ns"]).to_list()
    want = 2 * 2 * MB / 1e9 * 1e9 if path == "exact" else 0  # ns
    assert extra == [pytest.approx(want, abs=2)] * 6


@pytest.mark.parametrize("reclaim_us", [0.0, 3.0])
def test_a_memory_limit_reclaims_inside_the_read(reclaim_us):
    """direct_reclaim (a memory control group at its limit): a page cache of one 1 MiB bundle
    and two experts alternating, so every read is cold and pushes one bundle out; the reading
    thread frees its 256 pages inside the read at the measured reclaim figure (3 us a page), or
    where a profile has none at the page-drop figure (2 us): each load and each step's blocked
    time 256 pages x that longer than without, and graph building unchanged."""
    m = model(layers=1, experts=16, k=1, build_ms_per_layer=0.5)
    router = np.array([[[s % 2]] for s in range(20)], dtype=np.int16)
    io = dict(IO, ram_gib=64.0, os_reserve_gib=64.0 - 2 / 1024, page_drop_us_per_page=2.0,
              reclaim_us_per_page=reclaim_us)
    per_page_ns = (reclaim_us or 2.0) * 1e3

    def run(reclaim: bool) -> tuple[pl.DataFrame, pl.DataFrame]:
        sc = scenario(hw=hardware(**io), m=m, path="hot", lru_bytes=MB, decode_steps=20,
                      direct_reclaim=reclaim)
        res = run_scenario(sc, routing=routing_input(router))
        return (res.trace.steps.filter(pl.col("phase") == "decode").tail(10),
                res.trace.loads.tail(10))

    (steps0, loads0), (steps, loads) = run(False), run(True)
    assert loads["cold"].to_list() == [True] * 10
    took = ((loads["finished_ns"] - loads["started_ns"])
            - (loads0["finished_ns"] - loads0["started_ns"])).to_list()
    assert took == [pytest.approx(256 * per_page_ns, abs=2)] * 10
    assert (steps["blocked_ns"] - steps0["blocked_ns"]).to_list() == [
        pytest.approx(256 * per_page_ns, abs=2)] * 10
    assert steps["build_ns"].to_list() == steps0["build_ns"].to_list()
