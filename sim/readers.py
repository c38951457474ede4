"""Reader threads: `n` SimPy processes taking loads from one software queue, demand loads ahead
of prefetches (FIFO within a priority), one load at a time each, never preempted; each load's
copy and fault work runs on the host's shared cores (sim.loads).

A prefetch the main thread finds it needs is promoted: queued again as a demand load (the stale
entry is skipped when it surfaces).

Wake-up (`reader_wake_ms`): a reader idle on the queue starts a load handed to it `wake_s`
late, not at once: in the engine (engine.readers) the queue put wakes a thread blocked in
`get`, which then needs a core and the GIL before it claims the ticket. Meanwhile the load is
unclaimed, so a main thread that needs it reads it itself (help_reads), as the engine's does;
the reader then skips it. A reader that finds work queued when it finishes one starts at once.

Hand-off (`handoff_ms`): a main thread that blocks on a load a reader is doing resumes
`handoff_s` after the load finishes, not at once: the event set and the main thread's wake-up
with the GIL. A load already finished when the main thread asks costs none.
"""

from __future__ import annotations

from collections.abc import Generator

import simpy

from contract.thresholds import INLINE_WARM_BYTES  # shared with the engine
from sim.loads import Fetcher, Load

__all__ = ["INLINE_WARM_BYTES", "DEMAND_PRIORITY", "PREFETCH_PRIORITY", "ReaderThreads"]

DEMAND_PRIORITY = 0
PREFETCH_PRIORITY = 1


class ReaderThreads:
    def __init__(self, env: simpy.Environment, n: int, fetcher: Fetcher,
                 handoff_s: float = 0.0, wake_s: float = 0.0) -> None:
        if n < 1:
            raise ValueError("a reader pool needs at least one reader")
        self.env = env
        self.n = n
        self.handoff_s = handoff_s
        self.wake_s = wake_s
        self.fetcher = fetcher
        self.queue = simpy.PriorityStore(env)
        self._seq = 0
        self.busy_s = 0.0
        for i in range(n):
            env.process(self._reader(f"reader{i}"))

    def submit(self, load: Load) -> None:
        self._seq += 1
        load.seq = self._seq
        self.queue.put(simpy.PriorityItem((load.priority, load.seq), load))

    def promote(self, load: Load) -> None:
        """The main thread needs a queued prefetch now: move it ahead as a demand read."""
        if load.started < 0 and load.priority != DEMAND_PRIORITY:
            load.priority = DEMAND_PRIORITY
            self.queue.put(simpy.PriorityItem((DEMAND_PRIORITY, load.seq), load))

    def _reader(self, name: str) -> Generator:
        while True:
            asked = self.queue.get()
            idle = not asked.triggered  # nothing queued: the thread sleeps until a put
            item = yield asked
            if idle and self.wake_s:
                yield self.env.timeout(self.wake_s)
            load: Load = item.item
            if load.started >= 0 or item.priority[0] != load.priority:
                continue  # superseded by its promoted entry
            start = self.env.now
            yield from self.fetcher.perform(load, name)
            self.busy_s += self.env.now - start
