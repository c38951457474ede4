"""The host's CPU cores: one shared resource for every thread that computes on the host.

Graph building and fill work (the main thread), a CPU backend's compute thread, reader
threads' syscalls, copies and page faults all ask for CPU time here. The kernel shares cores by
time slicing, so the model is processor sharing: with n jobs runnable on c cores each job
progresses at min(1, c / n) CPU seconds per second. Other processes' load (`background`, in
cores kept busy) takes its share first.

A job is `yield cores.work(seconds, thread)`: the event fires when the job has had `seconds`
of CPU. Arrivals and departures re-time the one pending completion (a generation number
retires stale timers), so a job costs one event whatever the contention.

With enough cores for every thread that can run at once (`unbounded`, or cores >= threads),
nobody ever waits for a core and `work` is a plain timeout: `tests/test_sim_cpu.py` checks
that the shared model gives the same times in that case.
"""

from __future__ import annotations

from collections import defaultdict

import simpy

EPS_S = 1e-12


class Cores:
    def __init__(self, env: simpy.Environment, cores: float, background: float = 0.0,
                 threads: int | None = None) -> None:
        """`threads`: the most threads that can ever ask for CPU at once (None: unknown). When
        the cores left by the background load hold them all, nobody can wait for a core and
        every job is a plain timeout (the shortcut the module doc describes)."""
        if cores < 0 or background < 0:
            raise ValueError("cores and background load must be >= 0")
        self.env = env
        capacity = max(cores - background, 0.05)
        # 0 cores: not modelled (every job runs at full speed)
        self.unbounded = cores == 0 or (threads is not None and capacity >= threads)
        self.capacity = 0.0 if self.unbounded else capacity
        self.jobs: dict[int, list] = {}  # id -> [remaining s, event, thread]
        self._next_id = 0
        self._at = 0.0  # time `remaining` was last brought up to date
        self._generation = 0
        self.busy_s: dict[str, float] = defaultdict(float)  # CPU seconds per thread name
        self.contended_s = 0.0  # wall time with more runnable jobs than cores

    def rate(self, n: int | None = None) -> float:
        """CPU seconds per second each of n runnable jobs gets."""
        n = len(self.jobs) if n is None else n
        if self.unbounded or n == 0:
            return 1.0
        return min(1.0, self.capacity / n)

    def work(self, seconds: float, thread: str = "main") -> simpy.Event:
        """An event that fires once `thread` has had `seconds` of CPU."""
        self.busy_s[thread] += seconds
        if self.unbounded or seconds <= 0:
            return self.env.timeout(max(seconds, 0.0))
        self._update()
        done = self.env.event()
        self._next_id += 1
        self.jobs[self._next_id] = [seconds, done, thread]
        self._schedule()
        return done

    def _update(self) -> None:
        """Charge the CPU given since the last update to every runnable job."""
        now = self.env.now
        elapsed = now - self._at
        if elapsed > 0 and self.jobs:
            given = elapsed * self.rate()
            if len(self.jobs) > self.capacity:
                self.contended_s += elapsed
            for job in self.jobs.values():
                job[0] -= given
        self._at = now

    def _schedule(self) -> None:
        # finish every job that is done, then time the next completion
        for key in [k for k, job in self.jobs.items() if job[0] <= EPS_S]:
            self.jobs.pop(key)[1].succeed()
        if not self.jobs:
            return
        self._generation += 1
        generation = self._generation
        soonest = min(job[0] for job in self.jobs.values())
        timer = self.env.timeout(soonest / self.rate())
        timer.callbacks.append(lambda _event: self._fire(generation))

    def _fire(self, generation: int) -> None:
        if generation != self._generation:
            return  # re-timed by a later arrival or departure
        self._update()
        self._schedule()
