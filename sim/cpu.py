"""The host's CPU cores: one shared resource for every thread that computes on the host.

Graph building and fill work (the main thread), a CPU backend's compute thread, reader
threads' syscalls, copies and page faults all ask for CPU time here. The kernel shares cores by
time slicing, so the model is processor sharing: with n jobs runnable on c cores each job
progresses at min(1, c / n) CPU seconds per second. Other processes' load (`background`, in
cores kept busy) takes its share first.

Reader threads can weigh more (`reader_weight`, the hardware's `reader_cpu_weight`): a thread
that wakes for a short burst of work is served before threads that use most of a core (Linux's
EEVDF places a waking thread by the CPU time it is owed; calibration.sched_probe measures it:
on this machine a 0.5 ms burst beside two spinning threads on two cores runs at the speed of a
whole core). With weights the cores are shared in proportion to them, no job faster than one
core (`weighted_shares`); a reader's read work then takes a core from graph building and a CPU
backend's compute thread rather than a fair share of one.

A thread back from the device (a pread's completion) that finds every core running a job waits
`core_wait_ms` (hardware) for one before its next work: `woken()`. Sharing alone would give it
a share at once; the kernel runs it ahead only of threads that used more than their share, and
a decoding engine's main and compute threads sleep and wake thousands of times a second
themselves, so it waits in the run queue until one of them blocks (calibration.core_wait_probe
measures the wait beside a decoding engine: ~0.06 ms on this project's 2-core VM).

A job is `yield cores.work(seconds, thread)` (sim.sharing: one event per job whatever the
contention). After the process has idled, a job's seconds grow by the measured slowdown at the
kernel's utilization average then (sim.idle_slowdown), fixed at the job's start.

`active_s()`: the time so far with some job in service (counted once `track_activity()` is
on), so a stretch's idle time is its length less the growth of that (sim.stall_wake).

With enough cores for every thread that can run at once (`unbounded`, or cores >= threads),
nobody ever waits for a core and `work` is a plain timeout: `tests/test_sim_cpu.py` checks
that the shared model gives the same times in that case.
"""

from __future__ import annotations

from collections.abc import Mapping

import simpy

from sim.idle_slowdown import IdleSlowdown
from sim.sharing import ProcessorSharing

READER_THREAD = "reader"  # reader threads are named reader0, reader1, ... (sim.reader_threads)


def weighted_shares(weights: Mapping[int, float], capacity: float) -> dict[int, float]:
    """Cores each job gets when `capacity` cores are shared in proportion to `weights`, none
    more than one core (a thread runs on one core at a time): a job whose share would pass one
    core gets one, and the rest is shared again among the others."""
    shares: dict[int, float] = {}
    left = dict(weights)
    while left:
        total = sum(left.values())
        full = [k for k, w in left.items() if capacity * w / total >= 1.0]
        if not full:
            shares.update({k: capacity * w / total for k, w in left.items()})
            break
        for k in full:
            shares[k] = 1.0
            del left[k]
        capacity -= len(full)
        if capacity <= 0:
            shares.update(dict.fromkeys(left, 0.0))
            break
    return shares


class Cores(ProcessorSharing):
    def __init__(self, env: simpy.Environment, cores: float, background: float = 0.0,
                 threads: int | None = None, idle: IdleSlowdown | None = None,
                 reader_weight: float = 1.0, core_wait_ms: float = 0.0) -> None:
        """`threads`: the most threads that can ever ask for CPU at once (None: unknown). When
        the cores left by the background load hold them all, nobody can wait for a core and
        every job is a plain timeout (the shortcut the module doc describes). `idle`: work
        runs slower after the process idled (sim.idle_slowdown). `reader_weight`: a reader
        thread's weight against every other thread's 1. `core_wait_ms`: a waking thread's wait
        for a core when every core is busy (`woken`)."""
        if cores < 0 or background < 0:
            raise ValueError("cores and background load must be >= 0")
        if reader_weight <= 0:
            raise ValueError("a reader thread's weight must be > 0")
        self.reader_weight = reader_weight
        self.core_wait_s = core_wait_ms / 1e3
        self.core_waits = 0  # wakes that found every core busy
        super().__init__(env)
        capacity = max(cores - background, 0.05)
        # 0 cores: not modelled (every job runs at full speed)
        self.unbounded = cores == 0 or (threads is not None and capacity >= threads)
        self.capacity = 0.0 if self.unbounded else capacity
        self.contended_s = 0.0  # wall time with more runnable jobs than cores
        self.idle = idle if idle is not None and idle.enabled and cores else None
        self._running = 0  # jobs in flight on the shortcut path (unbounded)
        self.tracking = self.idle is not None  # the shortcut counts its jobs in flight
        self._active = 0.0  # time with a job in service, up to _active_at
        self._active_at = 0.0

    def track_activity(self) -> None:
        """Keep `active_s()` (the shortcut path then counts its jobs in flight)."""
        self.tracking = True

    def active_s(self) -> float:
        """Time so far with at least one job in service."""
        busy = self._running > 0 if self.unbounded else bool(self.jobs)
        return self._active + (self.env.now - self._active_at if busy else 0.0)

    def _advance(self, busy: bool) -> None:
        """Bring the active time and the kernel's average (sim.idle_slowdown) up to now;
        `busy`: whether a job was in service since the last call."""
        now = self.env.now
        if busy:
            self._active += now - self._active_at
        self._active_at = now
        if self.idle is not None:
            self.idle.advance(now, busy)

    def woken(self) -> simpy.Event | None:
        """A thread back from the device: a timeout for its wait for a core when every core
        runs a job, else None (it runs at once)."""
        if self.core_wait_s <= 0 or self.unbounded or len(self.jobs) < self.capacity:
            return None
        self.core_waits += 1
        return self.env.timeout(self.core_wait_s)

    def rate(self, n: int | None = None) -> float:
        """CPU seconds per second each of n runnable jobs gets."""
        n = len(self.jobs) if n is None else n
        if self.unbounded or n == 0:
            return 1.0
        return min(1.0, self.capacity / n)

    def rates(self) -> dict[int, float]:
        if self.reader_weight == 1.0:  # plain sharing: no thread's name to look at
            return super().rates()
        readers = [k for k, job in self.jobs.items() if job[2].startswith(READER_THREAD)]
        if not readers or len(readers) == len(self.jobs):
            return super().rates()  # every job in service weighs the same
        weights = dict.fromkeys(self.jobs, 1.0) | dict.fromkeys(readers, self.reader_weight)
        return weighted_shares(weights, self.capacity)

    def on_elapsed(self, elapsed: float, n: int) -> None:
        if n > self.capacity:
            self.contended_s += elapsed

    def _update(self) -> None:
        self._advance(bool(self.jobs))
        super()._update()

    def work(self, seconds: float, thread: str = "main") -> simpy.Event:
        """An event that fires once `thread` has had `seconds` of CPU (more after the process
        idled: sim.idle_slowdown)."""
        if self.unbounded and self.tracking and seconds > 0:
            return self._counted(seconds, thread)
        if self.idle is not None and seconds > 0:
            self._advance(bool(self.jobs))  # up to now, before this job
            seconds *= self.idle.factor()
        if self.unbounded:
            self.busy_s[thread] += seconds
            return self.env.timeout(max(seconds, 0.0))
        return super().work(seconds, thread)

    def _counted(self, seconds: float, thread: str) -> simpy.Event:
        """The unbounded shortcut, with the jobs in flight counted (for the average and the
        active time)."""
        self._advance(self._running > 0)
        if self.idle is not None:
            seconds *= self.idle.factor()
        self.busy_s[thread] += seconds
        self._running += 1
        done = self.env.timeout(seconds)

        def finished(_event: simpy.Event) -> None:
            self._advance(True)
            self._running -= 1

        done.callbacks.append(finished)
        return done
