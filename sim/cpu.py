"""The host's CPU cores: one shared resource for every thread that computes on the host.

Graph building and fill work (the main thread), a CPU backend's compute thread, reader
threads' syscalls, copies and page faults all ask for CPU time here. The kernel shares cores by
time slicing, so the model is processor sharing: with n jobs runnable on c cores each job
progresses at min(1, c / n) CPU seconds per second. Other processes' load (`background`, in
cores kept busy) takes its share first.

A job is `yield cores.work(seconds, thread)` (sim.sharing: one event per job whatever the
contention).

Three corrections for this project's 2-core VM's scheduler (a burst weight for reader threads,
a wait for a core after each pread, and a slowdown after the process idled) were retired after
a held-out comparison: reports/transfer/retired.md.

With enough cores for every thread that can run at once (`unbounded`, or cores >= threads),
nobody ever waits for a core and `work` is a plain timeout: `tests/test_sim_cpu.py` checks
that the shared model gives the same times in that case.
"""

from __future__ import annotations

import simpy

from sim.sharing import ProcessorSharing

READER_THREAD = "reader"  # reader threads are named reader0, reader1, ... (sim.reader_threads)


class Cores(ProcessorSharing):
    def __init__(self, env: simpy.Environment, cores: float, background: float = 0.0,
                 threads: int | None = None) -> None:
        """`threads`: the most threads that can ever ask for CPU at once (None: unknown). When
        the cores left by the background load hold them all, nobody can wait for a core and
        every job is a plain timeout (the shortcut the module doc describes)."""
        if cores < 0 or background < 0:
            raise ValueError("cores and background load must be >= 0")
        super().__init__(env)
        capacity = max(cores - background, 0.05)
        # 0 cores: not modelled (every job runs at full speed)
        self.unbounded = cores == 0 or (threads is not None and capacity >= threads)
        self.capacity = 0.0 if self.unbounded else capacity
        self.contended_s = 0.0  # wall time with more runnable jobs than cores

    def rate(self, n: int | None = None) -> float:
        """CPU seconds per second each of n runnable jobs gets."""
        n = len(self.jobs) if n is None else n
        if self.unbounded or n == 0:
            return 1.0
        return min(1.0, self.capacity / n)

    def on_elapsed(self, elapsed: float, n: int) -> None:
        if n > self.capacity:
            self.contended_s += elapsed

    def work(self, seconds: float, thread: str = "main") -> simpy.Event:
        """An event that fires once `thread` has had `seconds` of CPU."""
        if self.unbounded:
            self.busy_s[thread] += seconds
            return self.env.timeout(max(seconds, 0.0))
        return super().work(seconds, thread)
