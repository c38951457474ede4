"""The storage device: `queue_depth` requests in service at once, each paying a fixed latency,
and one transfer pipe of `bandwidth` bytes/s that the requests in service share.

A load's read (`transfer`, a SimPy process: sim.loads) waits for a free queue slot, pays the
latency, then transfers its bytes at an equal share of the bandwidth with every other request
transferring at the same time (processor sharing, sim.sharing): a device with several reads in
flight serves them interleaved, not one after another. The kernel submits a large buffered read
as several requests at once (the block layer splits it at the queue's segment limit: a 2.6 MB
bundle is three on the Intel VM), so two readers' large reads progress together and finish
together, later than the first of them would behind a first-in-first-out pipe (on the wide
model, two readers and the main thread reading at once: reports/transfer/b-curves). Alone, a
read takes latency + bytes / bandwidth either way, so nothing calibrated on one read at a time
changes.

`read` computes the same device first in first out, arithmetically at submit time (no events):

    service start  s = max(arrival, earliest free queue slot)
    transfer start x = max(s + latency, pipe free)
    finish         f = x + bytes / bandwidth

kept for the swap's page-ins (sim.swap, costed when the main thread hands work over, so they
cannot wait on events) and the device's closed-form checks (with queue_depth 1 an M/D/1 queue
under Poisson arrivals). The two keep separate state: a page-in and a load's read do not queue
behind one another (they did while both were first in first out); only a scenario whose engine
pages (sim.memory_budget) has page-ins at all.

A read throttle (sim.token_bucket: the kernel's blk-throttle or a token bucket, bytes and/or
requests) may stand in front of the queue: a request enters service no earlier than the
throttle lets it through. Latency overlaps across the queue depth while bytes share the
bandwidth: throughput grows with request size and queue depth and saturates at `bandwidth`. The
device's queue is in arrival order, as NVMe queues are: demand-before-prefetch priority lives in
the engine's software queue (sim.reader_threads), not here.
"""

from __future__ import annotations

import heapq
from collections.abc import Generator
from dataclasses import dataclass, field

import simpy

from sim.sharing import ProcessorSharing
from sim.token_bucket import Throttle, admitted

EPS_S = 1e-12


@dataclass
class Device:
    latency_s: float
    bandwidth_bps: float  # bytes per second
    queue_depth: int = 1
    record: bool = False  # keep (arrival, start, finish) per request for queueing statistics
    _slots: list[float] = field(default_factory=list)
    _pipe_free: float = 0.0
    _last_arrival: float = 0.0
    requests: int = 0
    bytes_read: int = 0
    busy_s: float = 0.0  # pipe busy time (transfer), for utilisation
    log: list[tuple[float, float, float]] = field(default_factory=list)
    throttle_bytes: Throttle | None = None  # a read_bps throttle
    throttle_requests: Throttle | None = None  # a read_iops throttle
    _queue: simpy.Resource | None = None  # transfer's queue slots (made on first use)
    _pipe: ProcessorSharing | None = None  # transfer's shared bandwidth

    def __post_init__(self) -> None:
        if self.queue_depth < 1:
            raise ValueError("queue_depth must be >= 1")
        if self.bandwidth_bps <= 0 or self.latency_s < 0:
            raise ValueError("bandwidth must be > 0 and latency >= 0")
        self._slots = [0.0] * self.queue_depth

    def service_s(self, nbytes: int) -> float:
        """Time for one request on an idle device."""
        return self.latency_s + nbytes / self.bandwidth_bps

    def read(self, arrival: float, nbytes: int, requests: int = 1) -> tuple[float, float]:
        """Submit a read of `nbytes` at `arrival` (seconds); returns (service start, finish).
        `requests` > 1 models back-to-back reads of one thread (each pays the latency)."""
        assert arrival + EPS_S >= self._last_arrival, "device requests must arrive in time order"
        self._last_arrival = arrival
        arrival = admitted(arrival, nbytes, requests, self.throttle_bytes,
                           self.throttle_requests)
        free = self._slots[0]
        start = arrival if arrival > free else free
        xfer = start + self.latency_s * requests
        if self._pipe_free > xfer:
            xfer = self._pipe_free
        duration = nbytes / self.bandwidth_bps
        finish = xfer + duration
        self._pipe_free = finish
        heapq.heapreplace(self._slots, finish)
        self.requests += requests
        self.bytes_read += nbytes
        self.busy_s += duration
        if self.record:
            self.log.append((arrival, start, finish))
        return start, finish

    def transfer(self, env: simpy.Environment, nbytes: int, requests: int = 1) -> Generator:
        """The read of `nbytes` in `requests` (back to back, each paying the latency) as a
        process: admitted by the throttle, a queue slot, the latency, then the bytes at an equal
        share of the bandwidth with every request transferring at the same time. Requests must
        arrive in time order (the throttle's state is computed at arrival)."""
        arrival = admitted(env.now, nbytes, requests, self.throttle_bytes, self.throttle_requests)
        if arrival > env.now:
            yield env.timeout(arrival - env.now)
        if self._queue is None:
            self._queue = simpy.Resource(env, capacity=self.queue_depth)
            self._pipe = SharedPipe(env)
        with self._queue.request() as slot:
            yield slot
            start = env.now
            yield env.timeout(self.latency_s * requests)
            duration = nbytes / self.bandwidth_bps
            yield self._pipe.work(duration, "device")
        self.requests += requests
        self.bytes_read += nbytes
        self.busy_s += duration
        if self.record:
            self.log.append((arrival, start, env.now))


class SharedPipe(ProcessorSharing):
    """The device's bandwidth: n requests transferring at once each get 1/n of it."""

    def rate(self, n: int) -> float:
        return 1.0 / n if n > 1 else 1.0
