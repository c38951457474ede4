"""Python's global interpreter lock: the engine's threads run Python one at a time.

The main thread holds it while it builds a layer's graph and while it does a fill point's host
work; a reader thread needs it for a load's Python bookkeeping (`load_overhead_ms`: arrays,
rows, the budget's accounting) but not inside the read itself (pread releases it, so a load's
device time, copy and page faults run beside Python). So a reader whose read lands while the
main thread builds finishes its load only when that build step ends; a cold bundle, one pread
per tensor slice, takes it back after each slice (sim.loads, measured by
reports/validation/gil_probe.py). A GIL that is off (`Scenario.gil`,
the default for a simulated engine) costs nothing.

Hand-over (`gil_handoff_ms`): CPython's GIL is a flag under a mutex, not a queue. A release
clears the flag and signals one sleeping waiter; the OS wakes it `handoff_s` later (the median
release-to-run calibrate measures with a waiter back from a cold page read, as a reader is:
a wake-up across cores, calibration.compute_probes.gil_handoff_times), and it takes the lock
only if it is still free. Meanwhile a running thread that asks takes it at once: the main
thread going on to its next Python keeps it, and so does one back from a call shorter than
the wake-up. A woken waiter that finds the lock taken sleeps again until the next release.
Only a waiter that has waited CPython's switch interval (5 ms) makes the holder drop it for
it: then the lock is its own at the holder's next release (CPython drops it at the next check of
its eval loop, at most one Python segment earlier; the sim's segments are a layer's build,
well under the interval). The measurements behind this are in
reports/validation/history.md.

Taking it back (`take_back`): MLX's eval and async_eval and a wait on a reader's event let go of
the lock while they block, so the main thread returning from one runs Python again only once it
holds the lock: where a reader is doing a load's Python at that moment, the main thread waits
for it: a gather's async_eval takes longer where the reads of the next layer have just been
queued than where none have, with the same main-thread CPU in it and no wait for a core
(reports/validation/history.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator

import simpy

from sim.cpu import Cores

SWITCH_INTERVAL_S = 0.005  # CPython's sys.getswitchinterval() default


class Gil:
    def __init__(self, env: simpy.Environment, enabled: bool, handoff_s: float = 0.0,
                 interval_s: float = SWITCH_INTERVAL_S) -> None:
        self.enabled = enabled
        self.env = env
        self.handoff_s = handoff_s
        self.interval_s = interval_s
        self.holder: str | None = None
        self.promised = False  # a forced switch: the lock is the longest waiter's
        self.waking = False  # a woken waiter is on its way to the lock
        self.waiters: deque[tuple[str, simpy.Event, float]] = deque()
        self.waited_s = 0.0

    def run(self, cores: Cores, seconds: float, thread: str) -> Generator:
        """`seconds` of Python on `thread`: take the lock (if on), then the CPU."""
        if seconds <= 0:
            return
        if not self.enabled:
            yield cores.work(seconds, thread)
            return
        yield from self._take(thread)
        yield cores.work(seconds, thread)
        self._release()

    def take_back(self) -> Generator:
        """Take the lock back after a call that let go of it, as the main thread does (then
        lets it go again at once: its next Python takes it with `run`): free when nobody
        holds it (no SimPy event then), else wait to be woken with it."""
        if not self.enabled or (self.holder is None and not self.promised):
            return
        yield from self._take("main")  # only the main thread takes it back
        self._release()

    def _take(self, thread: str) -> Generator:
        if self.holder is None and not self.promised:
            self.holder = thread  # free: taken at once, whoever sleeps on it
            return
        asked = self.env.now
        granted = self.env.event()
        self.waiters.append((thread, granted, asked))
        yield granted  # the lock is ours (set by _wake)
        self.waited_s += self.env.now - asked

    def _release(self) -> None:
        self.holder = None
        if not self.waiters:
            return
        if self.env.now - self.waiters[0][2] >= self.interval_s:
            self.promised = True  # the holder was asked to drop it: the waiter's
            self.env.process(self._wake(forced=True))
        elif not self.waking:
            self.env.process(self._wake(forced=False))

    def _wake(self, forced: bool) -> Generator:
        """The first waiter wakes `handoff_s` after a release and takes the lock if nobody has
        (nobody can while it is promised to it)."""
        if not forced:
            self.waking = True
        yield self.env.timeout(self.handoff_s)
        if not forced:
            self.waking = False
        if not self.waiters or self.holder is not None:
            return  # taken meanwhile: it sleeps again until the next release
        self.promised = False
        thread, granted, _ = self.waiters.popleft()
        self.holder = thread
        granted.succeed()
