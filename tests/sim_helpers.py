"""Small scenarios built in code for the simulator tests (no TOML), and hand-made routing."""

from __future__ import annotations

import numpy as np
import simpy

from sim.cpu import Cores
from sim.loads import Fetcher, Load
from sim.page_cache import PageCache
from sim.routing_input import RoutingInput
from sim.scenario import GIB, Hardware, ModelProfile, Scenario
from sim.storage import Device

MB = 1 << 20


def hardware(**over) -> Hardware:
    values = dict(name="test-hw", ram_gib=64.0, os_reserve_gib=0.0, ssd_bandwidth_gbps=1.0,
                  ssd_latency_ms=0.1, queue_depth=1, load_overhead_ms=0.0, cold_overhead_ms=0.0,
                  memcpy_gbps=0.0, readahead=True, cpu_factor=1.0, mem_bandwidth_gbps=100.0,
                  compute_tflops=1.0, slot_update_ms=0.0)
    values.update(over)
    return Hardware(**values)


def model(**over) -> ModelProfile:
    values = dict(name="test-model", layers=2, experts=16, k=2, bundle_bytes=MB,
                  resident_bytes=0, active_params=1e6, kv_bytes_per_token=0, consumer_first=-1,
                  consumer_last=-1, heads=0, head_bytes=0, build_ms_per_layer=1.0,
                  head_build_ms=0.0)
    values.update(over)
    return ModelProfile(**values)


def scenario(hw: Hardware | None = None, m: ModelProfile | None = None, **over) -> Scenario:
    return Scenario(name="test", hardware=hw or hardware(), model=m or model(), **over)


def uniform_routing(steps: int, layers: int, experts: int, k: int, seed: int = 0,
                    popularity: np.ndarray | None = None) -> np.ndarray:
    """i.i.d. routing: each (step, layer) draws K distinct experts (uniform, or weighted by
    `popularity` over the experts), independent of every other draw."""
    rng = np.random.default_rng(seed)
    if popularity is None:
        keys = rng.random((steps, layers, experts))
    else:  # Efraimidis-Spirakis weighted sampling without replacement
        keys = rng.random((steps, layers, experts)) ** (1.0 / popularity)
    return np.argsort(-keys, axis=-1)[..., :k].astype(np.int16)


def routing_input(router: np.ndarray, predicted: np.ndarray | None = None) -> RoutingInput:
    plan = [("decode", 1, 0, i) for i in range(router.shape[0])]
    return RoutingInput(router, predicted, plan, "test")


def read_beside_compute(hw: Hardware, nbytes: int, device: Device, compute_ms: float,
                        warm: bool = False) -> tuple[float, float]:
    """One bundle of `nbytes` (cold, or `warm` in the page cache) read by a reader from t=0 on a
    host of ONE core, while a compute job of `compute_ms` runs from t=0 (0: none). Returns
    (load finished, compute finished) in ms."""
    env = simpy.Environment()
    cores = Cores(env, 1, threads=2)
    pc = PageCache(10 * nbytes, nbytes, 16)
    f = Fetcher(env, hw, device, pc, cores, 16, nbytes)
    load = Load(0, 0, 3, 3, nbytes, 1, "prefetch", 0.0, env.event())
    if warm:
        pc.fill(3, (0, 0))
    seen = {"compute": 0.0}

    def compute():
        yield cores.work(compute_ms / 1e3, "compute")
        seen["compute"] = env.now * 1e3

    if compute_ms:
        env.process(compute())
    env.process(f.perform(load, "reader0"))
    env.run()
    return load.finished * 1e3, seen["compute"]


__all__ = ["GIB", "MB", "hardware", "model", "scenario", "uniform_routing", "routing_input",
           "read_beside_compute"]
