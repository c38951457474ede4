"""Reader threads: `n` workers taking loads from one software queue, demand loads ahead of
prefetches (FIFO within a priority), one load at a time each, never preempted.

Simulated analytically instead of one SimPy process per reader: the main thread is the only
producer and its clock only moves forward, so a queued load's start can be decided as soon as
every load that could precede it is known. `advance(t)` starts every load whose start is before
t (call it before submitting or doing I/O at t); `finish(load)` starts loads in queue order until
`load` has started, which is final because the main thread blocks on it and submits nothing
meanwhile. This gives the exact non-preemptive priority M/G/c behaviour without per-read events,
which is what keeps 1,000 decode steps of a 40-layer model well under 5 s.

Hand-off (`handoff_ms`): a main thread that blocks on a load a reader is doing resumes
`handoff_s` after the load finishes, not at once: in the engine (engine.readers) that is the
queue put, the reader's wake-up, the event set and the main thread's wake-up with the GIL.
`resume(load, now)` applies it; a load already finished when the main thread asks costs none.
"""

from __future__ import annotations

import heapq

from contract.thresholds import INLINE_WARM_BYTES  # shared with the engine
from sim.loads import Fetcher, Load

__all__ = ["INLINE_WARM_BYTES", "DEMAND_PRIORITY", "PREFETCH_PRIORITY", "ReaderPool"]

DEMAND_PRIORITY = 0
PREFETCH_PRIORITY = 1


class ReaderPool:
    def __init__(self, n: int, fetcher: Fetcher, handoff_s: float = 0.0) -> None:
        if n < 1:
            raise ValueError("a reader pool needs at least one reader")
        self.handoff_s = handoff_s
        self.free = [0.0] * n  # when each reader is next idle
        self.names = [f"reader{i}" for i in range(n)]
        self.fetcher = fetcher
        self.queue: list[tuple[int, int, Load]] = []
        self._seq = 0
        self.busy_s = 0.0

    def submit(self, load: Load) -> None:
        self._seq += 1
        load.seq = self._seq
        heapq.heappush(self.queue, (load.priority, load.seq, load))

    def promote(self, load: Load) -> None:
        """The main thread needs a queued prefetch now: move it ahead as a demand read."""
        if load.started < 0 and load.priority != DEMAND_PRIORITY:
            load.priority = DEMAND_PRIORITY
            heapq.heappush(self.queue, (DEMAND_PRIORITY, load.seq, load))

    def _start_next(self) -> Load | None:
        queue = self.queue
        while queue:
            priority, _, load = heapq.heappop(queue)
            if priority == load.priority and load.started < 0:  # skip superseded entries
                break
        else:
            return None
        free = self.free
        r = min(range(len(free)), key=free.__getitem__)
        start = free[r] if free[r] > load.issued else load.issued
        free[r] = self.fetcher.perform(load, start, self.names[r])
        self.busy_s += free[r] - start
        return load

    def advance(self, t: float) -> None:
        """Start every queued load that a reader picks up before time t."""
        while self.queue and min(self.free) < t:
            if self._start_next() is None:
                return

    def finish(self, load: Load) -> float:
        """Start loads in queue order until `load` has started; returns its finish time."""
        while load.started < 0:
            if self._start_next() is None:
                raise RuntimeError("load was never submitted")
        return load.finished

    def resume(self, load: Load, now: float) -> float:
        """When a main thread that needs `load` at `now` runs again: now if the load is done,
        else its finish plus the thread hand-off."""
        finished = self.finish(load)
        return finished + self.handoff_s if finished > now else now
