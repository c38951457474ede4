"""The storage device: `queue_depth` requests in service at once, each paying a fixed latency,
and one shared transfer pipe at `bandwidth` bytes/s.

    service start  s = max(arrival, earliest free queue slot)
    transfer start x = max(s + latency, pipe free)
    finish         f = x + bytes / bandwidth

A read throttle (sim.token_bucket: the kernel's blk-throttle or a token bucket, bytes and/or
requests) may stand in front of the queue: a request enters service no earlier than the
throttle lets it through.

So latency overlaps across the queue depth while bytes share the bandwidth: effective throughput
grows with request size and queue depth and saturates at `bandwidth`. With queue_depth 1 it is a
plain FIFO server with deterministic service latency + bytes/bandwidth (an M/D/1 queue under
Poisson arrivals). The device itself is FIFO, as NVMe queues are: demand-before-prefetch priority
lives in the engine's software queue (sim.reader_threads), not here.

Completion times are computed arithmetically when a request is submitted (no SimPy events per
read), which is exact as long as requests arrive in nondecreasing time order; `read` asserts it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

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
