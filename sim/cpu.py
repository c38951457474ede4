"""The host's CPU cores: one shared resource for every thread that computes on the host.

Graph building and fill work (the main thread), a CPU backend's compute thread, reader
threads' syscalls, copies and page faults all ask for CPU time here. The kernel shares cores by
time slicing, so the model is processor sharing, with one rule of the kernel's scheduler:
threads that sleep between short bursts run first. Linux's EEVDF (and CFS before it) keeps
the lag of a thread that slept, so when the main thread or a reader wakes for a burst shorter
than a time slice it takes a core from a thread that computes without pause (MLX's CPU compute
thread) and finishes the burst; the compute thread gets the cores they leave. Among the
sleepers, with n runnable on c cores, each progresses at min(1, c / n) CPU seconds per second.
Other processes' load (`background`, in cores kept busy) takes its share first. (Measured on
one core and under a CPU quota, reports/transfer: the main thread's graph building is not
stretched by the compute thread beside it; its eval waits are.)

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
COMPUTE_THREAD = "compute"  # MLX's CPU compute thread (sim.compute_stream): it never sleeps
# while it has work, so the threads that do (main, readers) run before it


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

    def on_elapsed(self, elapsed: float, n: int) -> None:
        if n > self.capacity:
            self.contended_s += elapsed

    def work(self, seconds: float, thread: str = "main") -> simpy.Event:
        """An event that fires once `thread` has had `seconds` of CPU."""
        if self.unbounded:
            self.busy_s[thread] += seconds
            return self.env.timeout(max(seconds, 0.0))
        return super().work(seconds, thread)

    def rates(self) -> dict[int, float]:
        """The sleepers (every thread but the compute thread) share the cores first, each at
        most one; the compute thread gets what they leave."""
        if self.unbounded:
            return dict.fromkeys(self.jobs, 1.0)
        hogs = {k for k, job in self.jobs.items() if job[2] == COMPUTE_THREAD}
        sleepers = [k for k in self.jobs if k not in hogs]
        out: dict[int, float] = {}
        left = self.capacity
        if sleepers:
            rate = min(1.0, self.capacity / len(sleepers))
            out.update(dict.fromkeys(sleepers, rate))
            left = max(self.capacity - rate * len(sleepers), 0.0)
        if hogs:
            out.update(dict.fromkeys(hogs, min(1.0, left / len(hogs))))
        return out
