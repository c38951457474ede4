"""The storage device as SimPy processes and resources: the reference model that sim.storage's
closed form stands in for.

A read passes the throttle (sim.token_bucket: blk-throttle or a token bucket, FIFO), takes one of
`queue_depth` service slots (a Resource: FIFO when all are busy), pays the device latency, then
takes the one transfer pipe (a Resource of capacity 1) for bytes / bandwidth, and frees both.
The simulator runs the closed form (sim.storage.Device: one arithmetic step per read instead
of four events); tests/test_sim_device.py checks that both give the same finish time for every
read.
"""

from __future__ import annotations

from collections.abc import Generator

import simpy

from sim.token_bucket import Throttle, admitted


class DeviceProcess:
    def __init__(self, env: simpy.Environment, latency_s: float, bandwidth_bps: float,
                 queue_depth: int = 1, throttle_bytes: Throttle | None = None,
                 throttle_requests: Throttle | None = None) -> None:
        self.env = env
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.slots = simpy.Resource(env, capacity=queue_depth)
        self.pipe = simpy.Resource(env, capacity=1)
        self.throttle_bytes = throttle_bytes
        self.throttle_requests = throttle_requests
        self._gate: simpy.Event | None = None  # the last read through the throttle

    def read(self, nbytes: int, requests: int = 1) -> Generator:
        """A SimPy sub-process reading `nbytes` now; returns (service start, finish)."""
        env = self.env
        passed = admitted(env.now, nbytes, requests, self.throttle_bytes,
                          self.throttle_requests)
        before, mine = self._gate, env.event()
        self._gate = mine
        if passed > env.now:
            yield env.timeout(passed - env.now)
        if before is not None and not before.processed:
            # reads released together (a throttle slice) leave it in arrival order, as the
            # kernel dispatches its queued bios, not in the order float rounding puts them
            yield before
        mine.succeed()
        with self.slots.request() as slot:
            yield slot
            start = env.now
            yield env.timeout(self.latency_s * requests)
            with self.pipe.request() as pipe:
                yield pipe
                yield env.timeout(nbytes / self.bandwidth_bps)
        return start, env.now
