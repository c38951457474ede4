"""How far concurrent cold bundle reads overlap on the device, fitted from the engine's own reads.

`ssdmoe calibrate` reads cold bundles through the engine's store on n threads at once
(calibration.concurrent_reads: each thread its own bundles, page cache dropped) and measures
how long one read takes at each n, paired with a read alone in the same round. This module runs
the same experiment in the sim
(sim.loads on a sim.shared_device device and the host's sim.cpu cores, the GIL held for each
read's Python, no compute) and finds, for n = 2, 3, ..., the device's `queue_speedup` at which
the simulated read takes as much longer than a read alone as the measured one does. Ratios, so
the fit does not move what a single read costs (latency, bandwidth and the read's CPU stay
where the storage probes put them); it moves only how concurrent reads share the device.

Why not the 4 KiB O_DIRECT speedup the storage probes measure: the engine's reads are buffered
reads of whole bundles, and concurrent reads of that size overlap far less on a device than
small O_DIRECT ones do; with the small reads' curve the simulated reads inside decode came out
short wherever reader threads read cold (reports/validation/history.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Generator

import simpy

from sim.bisection import decreasing_root
from sim.cpu import READER_THREAD, Cores
from sim.gil import Gil
from sim.loads import Fetcher, Load
from sim.page_cache import PageCache
from sim.scenario import Hardware
from sim.shared_device import SharedDevice
from traces.schema import PREFETCH

READS_PER_THREAD = 40
EXPERTS = 64  # bundles per layer in the simulated store: keys only, spaced apart (no edges)


def simulated_read_ms(hw: Hardware, speedup: list[float], threads: int, bundle_bytes: int,
                      bundle_reads: int, reads: int = READS_PER_THREAD) -> float:
    """Mean wall ms of one cold bundle read with `threads` threads each reading `reads`
    bundles back to back (the probe's experiment), on a device with this speedup curve. The
    mean, not the probe's median: the sim is deterministic and its threads run in lockstep, so
    a median jumps from read to read as the curve moves where the mean moves smoothly."""
    env = simpy.Environment()
    device = SharedDevice(env, hw.ssd_latency_ms / 1e3, hw.ssd_bandwidth_gbps * 1e9, speedup)
    # no core wait (hardware core_wait_ms): the curve is fitted to reads on n threads alone,
    # and carries what they cost each other, their wait for cores included
    cores = Cores(env, hw.cpu_cores, hw.background_cores, threads)
    page_cache = PageCache(1 << 62, bundle_bytes, EXPERTS)
    fetcher = Fetcher(env, hw, device, page_cache, cores, EXPERTS, bundle_bytes,
                      gil=Gil(env, True, hw.gil_handoff_ms / 1e3), bundle_reads=bundle_reads)
    walls: list[float] = []

    def reader(i: int) -> Generator:
        for j in range(reads):
            key = 3 * (i * reads + j) + 1  # every third key: no neighbour's pages shared
            load = Load(0, key // EXPERTS, key % EXPERTS, key, bundle_bytes, 1, PREFETCH,
                        env.now, env.event())
            yield from fetcher.perform(load, f"{READER_THREAD}{i}")
            walls.append(load.finished - load.started)

    for i in range(threads):
        env.process(reader(i))
    env.run()
    return statistics.fmean(walls) * 1e3


def counts_from_one(by_threads: dict[int, float]) -> int:
    """The most threads n such that every count 1..n was measured (0: not even one)."""
    n = 0
    while n + 1 in by_threads:
        n += 1
    return n


def fit_speedup(hw: Hardware, measured_ms: dict[int, float], bundle_bytes: int,
                bundle_reads: int, reads: int = READS_PER_THREAD) -> list[float]:
    """The speedup curve [1.0, s(2), ..., s(N)] (N: the most threads measured, every count
    from 1 up) under which the simulated read at n threads is measured_ms[n] / measured_ms[1]
    times the simulated read alone. s(n) lies in [s(n-1), n] (more reads in flight never
    finish slower together, nor faster than n alone); bisection, the simulated wall being
    monotone in s(n) (sim.bisection)."""
    if 1 not in measured_ms or measured_ms[1] <= 0:
        raise ValueError("the read alone (one thread) must be measured and > 0")
    top = counts_from_one(measured_ms)
    curve = [1.0]
    alone = simulated_read_ms(hw, curve, 1, bundle_bytes, bundle_reads, reads)
    for n in range(2, top + 1):
        target = measured_ms[n] / measured_ms[1] * alone
        lo, hi = curve[-1], float(n)

        def wall(s: float, n: int = n) -> float:
            return simulated_read_ms(hw, [*curve, s], n, bundle_bytes, bundle_reads, reads)

        if wall(lo) <= target:  # overlaps no worse than the last count: as that one
            curve.append(lo)
            continue
        if wall(hi) >= target:  # as good as n reads fully apart, or the CPU bounds it
            curve.append(hi)
            continue
        curve.append(round(decreasing_root(wall, target, lo, hi, 20), 3))
    return curve


def extend(curve: list[float], shape: list[float], length: int) -> list[float]:
    """`curve` continued to `length` points by `shape`'s growth past curve's last count
    (the O_DIRECT probe's speedup measured to more threads), never above n nor below the
    count before (a noisy probe can dip: more reads in flight never finish slower together)."""
    out = list(curve)
    last = len(curve)
    for n in range(last + 1, length + 1):
        if n > len(shape) or shape[last - 1] <= 0:
            out.append(out[-1])
            continue
        grown = curve[-1] * shape[n - 1] / shape[last - 1]
        out.append(round(min(max(grown, out[-1]), float(n)), 3))
    return out
