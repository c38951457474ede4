"""Python's global interpreter lock: the engine's threads run Python one at a time.

The main thread holds it while it builds a layer's graph and while it does a fill point's host
work; a reader thread needs it for a load's Python bookkeeping (`load_overhead_ms`: arrays,
rows, the budget's accounting) but not inside the read itself (pread releases it, so a load's
device time, copy and page faults run beside Python). So a reader whose read lands while the
main thread builds finishes its load only when that build step ends; a cold bundle, one pread
per tensor slice, takes it back after each slice (sim.loads, measured by
reports/validation/gil_probe.py). A Resource of one slot; a GIL that is off (`Scenario.gil`,
the default for a simulated engine) costs nothing.

Hand-over (`gil_handoff_ms`): a thread that slept on the lock does not run the moment the holder
lets go. The holder signals it and the OS wakes it, and until then no thread runs Python (the
lock is promised to it). So a contended take holds the lock `handoff_s` before its work starts;
an uncontended take is free. The figure is the median release-to-run time calibrate measures
(calibration.compute_probes.gil_handoff_times); a core for the woken thread is sim.cpu's.

Taking it back (`take_back`): MLX's eval and async_eval and a wait on a reader's event let go of
the lock while they block, so the main thread returning from one runs Python again only once it
holds the lock: where a reader is doing a load's Python at that moment, the main thread waits
for it. Measured (session 24, tiny-trained, staged with the layer lead at a full page cache):
a gather's async_eval took 0.14-0.25 ms where the reads of the next layer had just been queued
and 0.08 where none had, with the same main-thread CPU in it and no wait for a core.
"""

from __future__ import annotations

from collections.abc import Generator

import simpy

from sim.cpu import Cores


class Gil:
    def __init__(self, env: simpy.Environment, enabled: bool, handoff_s: float = 0.0) -> None:
        self.enabled = enabled
        self.lock = simpy.Resource(env, capacity=1) if enabled else None
        self.handoff_s = handoff_s
        self.waited_s = 0.0
        self.env = env

    def run(self, cores: Cores, seconds: float, thread: str) -> Generator:
        """`seconds` of Python on `thread`: take the lock (if on), then the CPU."""
        if seconds <= 0:
            return
        if self.lock is None:
            yield cores.work(seconds, thread)
            return
        asked = self.env.now
        with self.lock.request() as held:
            yield held
            if self.env.now > asked and self.handoff_s > 0:  # it slept on the lock
                yield self.env.timeout(self.handoff_s)
            self.waited_s += self.env.now - asked
            yield cores.work(seconds, thread)

    def take_back(self) -> Generator:
        """Take the lock back after a call that let go of it: free when no thread holds or
        waits for it (no SimPy event then), else wait for the holder and the hand-over."""
        lock = self.lock
        if lock is None or (not lock.count and not lock.queue):
            return
        asked = self.env.now
        with lock.request() as held:
            yield held
            if self.handoff_s > 0:
                yield self.env.timeout(self.handoff_s)
            self.waited_s += self.env.now - asked
