"""Scheduler probe: does a thread waking for a short burst of work get a core before threads that
keep one busy?

The engine's reader threads sleep on the queue or the device and wake for a read's kernel work
(a copy, page faults: a fraction of a millisecond); graph building and a CPU backend's compute
thread keep cores busy. Plain processor sharing would give a waking reader a fair share of a
core beside them. Linux's EEVDF instead places a waking thread by the CPU time it is owed, so a
short burst runs ahead of threads that used more than their share.

The probe: `cores` processes spinning, beside `cores` processes that wake together every
PERIOD_MS (at the same instants of the monotonic clock) and spin for BURST_MS of their own CPU
time, then sleep again. Each burst's rate is its CPU time over its wall time (1: a whole core
throughout). With every process runnable, sharing weighted w for a burst and 1 for a spinner
(sim.cpu) gives a burst w / (w + 1) of a core, so the weight is r / (1 - r) for the median
rate r, at most MAX_WEIGHT (a burst that never waits). Plain sharing gives r = 1/2, weight 1.
Rounds alternate with an arm without spinners, whose median rate says how far the bursts
run alone (a noisy machine's floor); the weight is not fitted when that arm does not
reach FLOOR.

On a kernel that serves a waking thread's short burst first (EEVDF), the bursts run at nearly
a full core beside the spinners (reports/validation/history.md).

    found = measure_reader_weight()  # ReaderWeight(weight, rate, alone_rate, ...), or None

Processes, not threads: Python threads would contend for the GIL rather than for cores.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass

BURST_MS = 0.5  # a cold read's kernel work on this machine is 0.1-0.6 ms
PERIOD_MS = 1.5  # a burst every 1.5 ms: a third of a core per bursting process
SECONDS = 2.0  # per arm and round
MAX_WEIGHT = 1000.0  # a burst that never waits: the sim's readers are then served first
FLOOR = 0.9  # the bursts alone must run at least this fast for the arm beside spinners to say
# anything (a busy machine slows both arms alike)


@dataclass
class ReaderWeight:
    weight: float  # r / (1 - r), within [1, MAX_WEIGHT]
    rate: float  # median burst rate beside the spinners (cores of CPU per second of wall)
    alone_rate: float  # the same without spinners
    bursts: int  # bursts measured beside the spinners
    cores: int
    rounds: int


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(5000):
            pass


def _burst(stop, start: float, out) -> None:
    """Wake at start + i x PERIOD_MS, spin BURST_MS of this process's CPU time; the rates."""
    rates = []
    i = 0
    while not stop.is_set():
        i += 1
        wait = start + i * PERIOD_MS / 1e3 - time.monotonic()
        if wait <= 0:
            continue  # fell behind: wait for the next instant the others wake at
        time.sleep(wait)
        wall, cpu = time.perf_counter(), time.process_time()
        while time.process_time() - cpu < BURST_MS / 1e3:
            pass
        rates.append((time.process_time() - cpu) / (time.perf_counter() - wall))
    out.put(rates)


def burst_rates(cores: int, spinners: int, seconds: float = SECONDS) -> list[float]:
    """Every burst's rate of `cores` bursting processes beside `spinners` spinning ones."""
    ctx = mp.get_context("spawn")  # the same on every platform; no inherited state
    stop, out = ctx.Event(), ctx.Queue()
    start = time.monotonic() + 0.5  # the processes start before the first burst
    procs = [ctx.Process(target=_spin, args=(stop,)) for _ in range(spinners)]
    procs += [ctx.Process(target=_burst, args=(stop, start, out)) for _ in range(cores)]
    for p in procs:
        p.start()
    time.sleep(max(start - time.monotonic(), 0.0) + seconds)
    stop.set()
    rates = [r for _ in range(cores) for r in out.get(timeout=30)]
    for p in procs:
        p.join(timeout=30)
    return rates


def weight_of(rate: float) -> float:
    """A burst's weight from its rate beside as many spinners as bursts: r = w / (w + 1)."""
    if rate >= 1.0:
        return MAX_WEIGHT
    return min(max(rate / (1.0 - rate), 1.0), MAX_WEIGHT)


def measure_reader_weight(cores: int | None = None, rounds: int = 2,
                          seconds: float = SECONDS) -> ReaderWeight | None:
    """The probe on this machine's cores (those this process may run on); None when the
    bursts alone do not run at FLOOR (the machine too busy to tell)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    beside: list[float] = []
    alone: list[float] = []
    for r in range(rounds):  # arms alternate, the order rotated
        for spinners in ((0, cores) if r % 2 == 0 else (cores, 0)):
            (beside if spinners else alone).extend(burst_rates(cores, spinners, seconds))
    if not beside or not alone:
        return None
    alone_rate = statistics.median(alone)
    if not math.isfinite(alone_rate) or alone_rate < FLOOR:
        return None
    rate = statistics.median(beside)
    return ReaderWeight(weight_of(rate), rate, alone_rate, len(beside), cores, rounds)


if __name__ == "__main__":
    print(measure_reader_weight())
