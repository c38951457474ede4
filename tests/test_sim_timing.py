"""Main-thread timing against hand-worked step times."""

from __future__ import annotations

import polars as pl
import pytest
from sim_helpers import MB, hardware, model, routing_input, scenario, uniform_routing

from sim.replay import run_scenario

FREE_IO = dict(ssd_latency_ms=0.0, ssd_bandwidth_gbps=1e12, load_overhead_ms=0.0,
               cold_overhead_ms=0.0, memcpy_gbps=0.0)


def _decode(result) -> pl.DataFrame:
    return result.trace.steps.filter(pl.col("phase") == "decode")


def test_zero_latency_storage_gives_the_compute_bound_rate_on_demand():
    # 4 layers; per layer: build b = 1 ms, attention a = R/L/B, experts x = K*bundle/B.
    m = model(layers=4, experts=16, k=2, resident_bytes=200 * MB, build_ms_per_layer=1.0)
    hw = hardware(mem_bandwidth_gbps=400.0, **FREE_IO)
    B = 400e9
    a, x, b = 200 * MB / 4 / B, 2 * MB / B, 1e-3
    assert x < b  # the accelerator is idle by the time the next layer syncs on its router
    router = uniform_routing(300, 4, 16, 2, seed=1)
    result = run_scenario(scenario(hw=hw, m=m, path="staged", decode_steps=300),
                          routing=routing_input(router))
    step = 4 * (b + a) + x  # each layer: build, then wait for its router; last: the experts
    assert result.metrics["decode_tok_s"] == pytest.approx(1 / step, rel=1e-9)
    assert result.metrics["blocked_ms_per_step"] == pytest.approx(0.0, abs=1e-9)
    assert result.figures.eval_ms_per_step == pytest.approx((4 * a + x) * 1e3, abs=2e-6)  # ns


@pytest.mark.parametrize(("read_bytes", "read"), [(0, 8 * MB), (2 * MB, 2 * MB)])
def test_zero_latency_storage_gives_the_compute_bound_rate_with_the_prerouter(read_bytes, read):
    # layers 1-3 consume predictions (no router sync), heads owned by layers 0-2; a head
    # reads `read` a step: head_read_bytes, or all its weights where that is 0 (a dense head)
    m = model(layers=4, experts=16, k=2, resident_bytes=200 * MB, build_ms_per_layer=1.0,
              consumer_first=1, consumer_last=3, heads=3, head_bytes=8 * MB, head_build_ms=0.25,
              head_read_bytes=read_bytes)
    hw = hardware(mem_bandwidth_gbps=400.0, **FREE_IO)
    B = 400e9
    a, x, hs, b, hb = 200 * MB / 4 / B, 2 * MB / B, read / B, 1e-3, 0.25e-3
    router = uniform_routing(300, 4, 16, 2, seed=2)
    result = run_scenario(scenario(hw=hw, m=m, lead="token", decode_steps=300),
                          routing=routing_input(router))
    # layer 0 (owner, router): b+hb, wait a+hs; layers 1-2 (owners, staged): b+hb each;
    # layer 3 (staged): b; then the accelerator finishes layer 3's a+x
    step = (b + hb) + (a + hs) + 2 * (b + hb) + b + (a + x)
    assert result.metrics["decode_tok_s"] == pytest.approx(1 / step, rel=1e-9)
    routing = result.trace.routing
    assert set(routing.filter(pl.col("layer") >= 1)["source"]) == {"prediction"}
    assert set(routing.filter(pl.col("layer") == 0)["source"]) == {"router"}


@pytest.mark.parametrize("readahead", [True, False])
def test_synchronous_cold_load_cost_by_hand(readahead):
    # 1 layer, K=1, alternating experts, one staged slot (headroom 0: the last token's
    # expert only, so no slot hit), no caches, O_DIRECT: every load cold.
    m = model(layers=1, experts=16, k=1, build_ms_per_layer=1.0)
    hw = hardware(ssd_latency_ms=0.1, ssd_bandwidth_gbps=1.0, load_overhead_ms=0.5,
                  cold_overhead_ms=0.3, mem_bandwidth_gbps=1e9, readahead=readahead)
    router = (pl.Series([0, 1] * 50).to_numpy().reshape(-1, 1, 1)).astype("int16")
    sc = scenario(hw=hw, m=m, path="staged", staged_headroom=0, decode_steps=100, o_direct=True,
                  demand_pieces=4)
    result = run_scenario(sc, routing=routing_input(router))
    steps = _decode(result)
    device_reads = 1 if readahead else 4  # readahead: the first piece's read brings the bundle
    load_ms = 0.1 * device_reads + MB / 1e9 * 1e3 + 4 * 0.5 + 0.3 * device_reads
    assert steps["blocked_ns"].to_list() == [round(load_ms * 1e6)] * 100
    assert steps["loads"].to_list() == [4] * 100
    assert steps["cold_loads"].to_list() == [device_reads] * 100
    assert steps["bytes_read"].to_list() == [MB] * 100
    loads = result.trace.loads.filter(pl.col("step") == 0)
    assert loads["wait_ns"].sum() == round(load_ms * 1e6)  # the wait sits on the last piece
    assert loads["waited"].to_list() == [False, False, False, True]
    assert loads["thread"].to_list() == ["main"] * 4


def test_background_readers_take_prefetch_off_the_main_thread():
    m = model(layers=8, experts=64, k=4, build_ms_per_layer=1.0, consumer_first=2,
              consumer_last=7, heads=6, head_bytes=0)
    hw = hardware(ssd_latency_ms=0.05, ssd_bandwidth_gbps=4.0, load_overhead_ms=0.1,
                  queue_depth=4, mem_bandwidth_gbps=1e9)
    router = uniform_routing(200, 8, 64, 4, seed=5)
    runs = {}
    for readers in (0, 2):
        sc = scenario(hw=hw, m=m, lead="token", decode_steps=200, readers=readers,
                      o_direct=True, help_reads=False)
        runs[readers] = run_scenario(sc, routing=routing_input(router))
    sync, bg = runs[0].metrics, runs[2].metrics
    assert sync["loads_per_step"] == bg["loads_per_step"]  # same reads, different threads
    # (the on-demand layers' misses queue behind the token lead's prefetches, first in first
    # out as in engine.readers, and help_reads is off: that part of the wait stays)
    assert bg["blocked_ms_per_step"] < 0.75 * sync["blocked_ms_per_step"]
    assert bg["decode_tok_s"] > sync["decode_tok_s"]
    threads = set(runs[2].trace.loads["thread"])
    assert threads == {"reader0", "reader1"}


def test_a_served_adapter_costs_its_bytes_and_build_time_by_hand():
    """lora=true: each layer's attention also reads lora_bytes / layers, each layer's graph
    takes lora_build_ms more to build, and the engine holds lora_bytes more; lora=false (the
    same profile) costs nothing."""
    from sim.memory_budget import budget

    m = model(layers=4, experts=16, k=2, resident_bytes=200 * MB, build_ms_per_layer=1.0,
              lora_bytes=40 * MB, lora_build_ms=0.25)
    hw = hardware(mem_bandwidth_gbps=400.0, **FREE_IO)
    B = 400e9
    router = uniform_routing(300, 4, 16, 2, seed=1)
    rates = {}
    for served in (False, True):
        sc = scenario(hw=hw, m=m, path="staged", decode_steps=300, lora=served)
        rates[served] = run_scenario(sc, routing=routing_input(router)).metrics["decode_tok_s"]
        extra = budget(sc).engine - budget(scenario(hw=hw, m=m, path="staged")).engine
        assert extra == (40 * MB if served else 0)
    a0, x = 200 * MB / 4 / B, 2 * MB / B
    assert rates[False] == pytest.approx(1 / (4 * (1e-3 + a0) + x), rel=1e-9)
    a1 = (200 + 40) * MB / 4 / B
    assert rates[True] == pytest.approx(1 / (4 * (1.25e-3 + a1) + x), rel=1e-9)


@pytest.mark.parametrize("lead", ["token", "none"])
def test_a_staged_fill_pays_its_host_work_per_load_on_the_main_thread(lead):
    """fill_host_ms_per_load: every bundle a staged fill loads (a prefetch staged ahead, or a
    demand miss) costs the main thread that much more CPU, whichever loop; nothing else moves
    but time. Hand-worked: the runs differ in main-thread CPU by loads x 0.2 ms exactly."""
    m = model(layers=4, experts=16, k=2, resident_bytes=200 * MB, build_ms_per_layer=1.0,
              consumer_first=1 if lead == "token" else -1, consumer_last=3 if lead == "token"
              else -1, heads=3 if lead == "token" else 0, head_bytes=0)
    router = uniform_routing(60, 4, 16, 2, seed=3)
    runs = []
    for host_ms in (0.0, 0.2):
        hw = hardware(mem_bandwidth_gbps=400.0, fill_host_ms_per_load=host_ms, **FREE_IO)
        result = run_scenario(scenario(hw=hw, m=m, path="staged", lead=lead, decode_steps=60),
                              routing=routing_input(router))
        runs.append(result.trace)
    base, paid = runs
    loads = base.loads.filter(pl.col("expert") >= 0).height
    assert loads == paid.loads.filter(pl.col("expert") >= 0).height > 0
    more = (paid.steps["main_cpu_ns"].sum() - base.steps["main_cpu_ns"].sum()) / 1e6
    assert more == pytest.approx(0.2 * loads, rel=1e-6)
