"""Reader threads: `n` SimPy processes taking loads from one first-in first-out queue, one load at
a time each, never preempted; each load's copy and fault work runs on the host's shared cores
(sim.loads). The engine's queue is one `queue.SimpleQueue` (engine.readers): a demand read
queued behind prefetches waits its turn, unless the main thread reads it itself first
(help_reads, sim.main_thread.wait).

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
from sim.cpu import READER_THREAD
from sim.loads import Fetcher, Load

__all__ = ["INLINE_WARM_BYTES", "ReaderThreads"]


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
        self.queue = simpy.Store(env)
        self.busy_s = 0.0
        for i in range(n):
            env.process(self._reader(f"{READER_THREAD}{i}"))

    def submit(self, load: Load) -> None:
        load.queued = True
        self.queue.put(load)

    def _reader(self, name: str) -> Generator:
        while True:
            asked = self.queue.get()
            idle = not asked.triggered  # nothing queued: the thread sleeps until a put
            load: Load = yield asked
            if idle and self.wake_s:
                yield self.env.timeout(self.wake_s)
            if load.started >= 0:
                continue  # the main thread read it meanwhile (help_reads)
            start = self.env.now
            yield from self.fetcher.perform(load, name)
            self.busy_s += self.env.now - start
