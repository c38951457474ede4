"""Storage device and reader queue against closed forms and hand-worked timelines."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from sim_helpers import hardware

from sim.cpu import Cores
from sim.loads import Fetcher, Load
from sim.page_cache import PageCache
from sim.reader_threads import ReaderThreads
from sim.storage import Device
from traces.schema import DEMAND, PREFETCH


def _poisson_run(device: Device, rate: float, nbytes_fn, n: int, seed: int) -> None:
    """SimPy source: Poisson arrivals submitted to the device at env.now."""
    env = simpy.Environment()
    rng = np.random.default_rng(seed)

    def source():
        for _ in range(n):
            yield env.timeout(rng.exponential(1.0 / rate))
            device.read(env.now, nbytes_fn(rng))

    env.process(source())
    env.run()


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_single_queue_matches_md1_waiting_time(rho):
    # deterministic service D = latency + bytes / bandwidth = 1 ms
    device = Device(latency_s=0.0004, bandwidth_bps=1e9, queue_depth=1, record=True)
    service = device.service_s(600_000)
    assert service == pytest.approx(1e-3)
    rate = rho / service
    _poisson_run(device, rate, lambda rng: 600_000, 200_000, seed=1)
    log = np.asarray(device.log)
    wq = (log[:, 1] - log[:, 0]).mean()
    mu = 1.0 / service
    closed_form = rho / (2 * mu * (1 - rho))  # Pollaczek-Khinchine for M/D/1
    assert wq == pytest.approx(closed_form, rel=0.05)
    assert np.allclose(log[:, 2] - log[:, 1], service)  # no waiting inside service


def _time_average_in_system(log: np.ndarray) -> float:
    """Time-average number of requests in the system, by sweeping arrivals (+1) and
    finishes (-1) over the run."""
    arrivals, finishes = log[:, 0], log[:, 2]
    times = np.concatenate([arrivals, finishes])
    steps = np.concatenate([np.ones(len(arrivals)), -np.ones(len(finishes))])
    order = np.argsort(times, kind="stable")
    in_system = np.cumsum(steps[order])
    return float((in_system[:-1] * np.diff(times[order])).sum() / (finishes.max() - arrivals.min()))


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_number_in_system_matches_md1_closed_form(rho):
    """L of a single FIFO queue with deterministic service under Poisson arrivals, against
    Pollaczek-Khinchine: L = rho + rho^2 / (2 (1 - rho)) (independent of the simulated W)."""
    device = Device(latency_s=0.0004, bandwidth_bps=1e9, queue_depth=1, record=True)
    service = device.service_s(600_000)
    _poisson_run(device, rho / service, lambda rng: 600_000, 200_000, seed=3)
    closed_form = rho + rho**2 / (2 * (1 - rho))
    assert _time_average_in_system(np.asarray(device.log)) == pytest.approx(closed_form, rel=0.05)


def test_queue_depth_overlaps_latency_but_shares_bandwidth():
    device = Device(latency_s=0.001, bandwidth_bps=1e9, queue_depth=2)
    # two tiny reads at once: both pay latency in parallel
    assert device.read(0.0, 0)[1] == pytest.approx(0.001)
    assert device.read(0.0, 0)[1] == pytest.approx(0.001)
    # two 1 MB reads at t=1: latency overlaps, transfers share the pipe
    assert device.read(1.0, 1_000_000)[1] == pytest.approx(1.002)
    assert device.read(1.0, 1_000_000)[1] == pytest.approx(1.003)
    # a third waits for a free slot (the first finishes at 1.002), then for the pipe
    start, finish = device.read(1.0, 1_000_000)
    assert start == pytest.approx(1.002)
    assert finish == pytest.approx(1.004)
    with pytest.raises(AssertionError):
        device.read(0.5, 10)  # arrivals must be in time order


def _readers(env: simpy.Environment, n: int, latency: float = 0.001,
             bandwidth: float = 1e9) -> ReaderThreads:
    hw = hardware(ssd_latency_ms=latency * 1e3, ssd_bandwidth_gbps=bandwidth / 1e9)
    device = Device(latency, bandwidth, queue_depth=8)
    pc = PageCache(0, 1_000_000, 16, enabled=False)
    return ReaderThreads(env, n, Fetcher(env, hw, device, pc, Cores(env, 0), 16, 1_000_000))


def _load(env: simpy.Environment, expert: int, source: str = PREFETCH) -> Load:
    return Load(0, 0, expert, expert, 1_000_000, 1, source, env.now, env.event())


def test_a_demand_read_waits_behind_queued_prefetches_as_in_the_engine():
    # engine.readers: one queue.SimpleQueue, first in first out; a demand read queued after
    # prefetches gets a reader only once they have started
    env = simpy.Environment()
    readers = _readers(env, 1)  # one reader; every read takes 1 ms latency + 1 ms transfer
    prefetches = [_load(env, e) for e in range(3)]
    demand = []

    def main():
        for ld in prefetches:
            readers.submit(ld)
        yield env.timeout(0.0005)  # the reader has started prefetch 0 at t=0
        demand.append(_load(env, 9, DEMAND))
        readers.submit(demand[0])

    env.process(main())
    env.run()
    assert [ld.finished for ld in prefetches] == pytest.approx([0.002, 0.004, 0.006])
    assert demand[0].started == pytest.approx(0.006)
    assert demand[0].finished == pytest.approx(0.008)


def test_two_readers_overlap_latency_and_share_the_bandwidth():
    env = simpy.Environment()
    readers = _readers(env, 2)
    loads = [_load(env, e) for e in range(4)]

    def main():
        for ld in loads:
            readers.submit(ld)
        yield env.timeout(0)

    env.process(main())
    env.run()
    # both readers start at t=0 (prefetch 0 and 1): the latencies overlap (1 ms), then both
    # transfer at once, each at half the bandwidth: 1 MB each at 0.5 GB/s, done at 3 ms; the
    # readers, free at 3 ms, take prefetch 2 and 3 in queue order, done at 6 ms
    assert [(ld.started, ld.finished) for ld in loads[:2]] == [
        (0.0, pytest.approx(0.003)), (0.0, pytest.approx(0.003))]
    assert loads[0].thread != loads[1].thread
    assert [(ld.started, ld.finished) for ld in loads[2:]] == [
        (pytest.approx(0.003), pytest.approx(0.006))] * 2
    assert loads[2].thread == loads[0].thread


def test_a_read_past_the_queue_depth_waits_for_a_slot_then_shares():
    """Queue depth 2, three reads of 1 MB at t=0 (1 ms latency, 1 GB/s): two in service share
    the pipe from 1 ms and finish at 3 ms; the third enters then and, alone, finishes at
    3 + 1 + 1 = 5 ms. A FIFO pipe (Device.read) finishes them at 2, 3 and 4 ms."""
    env = simpy.Environment()
    device = Device(0.001, 1e9, queue_depth=2)
    done: list[float] = []

    def read():
        yield from device.transfer(env, 1_000_000)
        done.append(env.now)

    for _ in range(3):
        env.process(read())
    env.run()
    assert done == [pytest.approx(0.003), pytest.approx(0.003), pytest.approx(0.005)]
    assert device.requests == 3 and device.bytes_read == 3_000_000
    assert device.busy_s == pytest.approx(0.003)
    fifo = Device(0.001, 1e9, queue_depth=2)
    assert [fifo.read(0.0, 1_000_000)[1] for _ in range(3)] == pytest.approx(
        [0.002, 0.003, 0.004])


def test_the_fifo_read_pays_the_latency_once_a_request():
    """Device.read (the swap's page-ins): one thread's back-to-back requests each pay the
    device's latency before the bytes, hand-worked: 3 x 1 ms + 2 MB at 1 GB/s = 5 ms."""
    device = Device(latency_s=0.001, bandwidth_bps=1e9, queue_depth=1)
    start, finish = device.read(0.0, 2_000_000, requests=3)
    assert (start, finish) == (0.0, pytest.approx(0.005))
    assert device.requests == 3
