"""The storage device as measured on a virtual or network disk: concurrent small reads overlap
only in part. With n requests in flight the device completes them at speedup(n) times the rate
of one alone (`queue_speedup`: fitted by `ssdmoe calibrate` to the engine's cold bundle reads on
n threads at once, sim.read_overlap; without those, 4 KiB O_DIRECT random-read IOPS with n
threads over one thread's), shared equally: processor sharing over each request's latency
(sim.sharing).
A read's bytes then pass the one transfer pipe, shared equally too (bandwidth does not grow
with threads). The read throttle admits a read first, as in sim.storage.

A speedup of n at every n is sim.storage's model at infinite queue depth; a speedup of 1 is one
request at a time. The slot model (sim.storage.Device, `queue_depth`) stays the default where
no speedup curve was measured (the paper's machines).
"""

from __future__ import annotations

from collections.abc import Generator

import simpy

from sim.sharing import ProcessorSharing
from sim.token_bucket import Throttle, admitted


class _Latency(ProcessorSharing):
    def __init__(self, env: simpy.Environment, speedup: list[float]) -> None:
        super().__init__(env)
        self.speedup = speedup

    def rate(self, n: int) -> float:
        s = self.speedup[min(n, len(self.speedup)) - 1]  # flat past the last one measured
        return min(1.0, s / n)


class _Pipe(ProcessorSharing):
    def rate(self, n: int) -> float:
        return 1.0 / n


class SharedDevice:
    def __init__(self, env: simpy.Environment, latency_s: float, bandwidth_bps: float,
                 speedup: list[float], throttle_bytes: Throttle | None = None,
                 throttle_requests: Throttle | None = None) -> None:
        if not speedup or speedup[0] != 1.0 or min(speedup) <= 0:
            raise ValueError("a speedup curve starts at 1.0 (one request) and stays > 0")
        if bandwidth_bps <= 0 or latency_s < 0:
            raise ValueError("bandwidth must be > 0 and latency >= 0")
        self.env = env
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.latency = _Latency(env, speedup)
        self.pipe = _Pipe(env)
        self.throttle_bytes = throttle_bytes
        self.throttle_requests = throttle_requests
        self.requests = 0
        self.bytes_read = 0
        self.busy_s = 0.0  # transfer time, for utilisation

    def read(self, nbytes: int, requests: int = 1) -> Generator:
        """A SimPy sub-process: `requests` back-to-back reads of `nbytes` in all, by one
        thread (each pays the latency); returns (service start, finish)."""
        env = self.env
        passed = admitted(env.now, nbytes, requests, self.throttle_bytes,
                          self.throttle_requests)
        if passed > env.now:
            yield env.timeout(passed - env.now)
        start = env.now
        yield self.latency.work(self.latency_s * requests, "device")
        duration = nbytes / self.bandwidth_bps
        yield self.pipe.work(duration, "device")
        self.requests += requests
        self.bytes_read += nbytes
        self.busy_s += duration
        return start, env.now
