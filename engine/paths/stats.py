"""Counters the execution paths share, per loaded model: app-cache hits/misses/evictions (hot
LRU, staged slots), main-thread time blocked on expert loads, and host syncs of routed ids.

Counters are cumulative and only ever grow; a consumer (the trace recorder, the benchmark)
takes `snapshot()` at step start and end and keeps the difference (`delta`). Only the main
thread updates them (paths run on the main thread; readers never touch them).

The runtime makes one and hands it to every path it builds (engine.runtime)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class PathStats:
    cache_hits: int = 0  # routed experts found resident (hot LRU row, staged slot)
    cache_misses: int = 0  # routed experts that had to be read
    cache_evictions: int = 0  # resident experts overwritten to make room
    blocked_ns: int = 0  # main thread blocked waiting on reader threads
    route_syncs: int = 0  # host syncs of routed ids (np.array(inds)): each evaluates the graph
    route_sync_ns: int = 0  # time inside them (graph evaluation up to the router included)
    deferred_syncs: int = 0  # host syncs of routed ids at fill points (engine.fill_points):
    deferred_sync_ns: int = 0  # during evaluation, after the graph is built; time inside them
    exact_fallbacks: int = 0  # calls that fell back to the exact path (set too large to hold)

    def snapshot(self) -> dict[str, int]:
        return asdict(self)

    @staticmethod
    def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
        return {k: after[k] - before.get(k, 0) for k in after}


def host_routed(inds, stats: PathStats, deferred: bool = False):
    """The routed ids on the host (np.ndarray). This is a host sync: it evaluates the graph up
    to this layer's router. During graph building it breaks MLX's build/evaluate overlap
    (`route_syncs`); at a fill point (`deferred`) the graph is already built and it costs only
    the host work (`deferred_syncs`). Counted and timed."""
    import time

    import numpy as np

    t0 = time.perf_counter_ns()
    host = np.array(inds, copy=True)
    if deferred:
        stats.deferred_sync_ns += time.perf_counter_ns() - t0
        stats.deferred_syncs += 1
    else:
        stats.route_sync_ns += time.perf_counter_ns() - t0
        stats.route_syncs += 1
    return host
