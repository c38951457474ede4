"""The accelerator's command stream (MLX's compute thread): work the main thread queues runs in
order, one item at a time.

  on an accelerator (Metal)   an item takes its duration of device time
  on a CPU backend            an item is CPU work on the host's cores (sim.cpu), so it slows
                              down when graph building and readers run beside it
  lazy                        MLX evaluates lazily: in the synchronous decode loop and at
                              prefill, queued work starts only at the next host sync (`sync`)
  sync overhead               a sync that finds work queued or running costs the stream
                              `sync_s` more (handing work over and waking the waiter)

`submit` returns the item's completion event; `sync` returns an event that fires when
everything queued so far has run. The stream is one SimPy process fed by a Store.
"""

from __future__ import annotations

import simpy

from sim.cpu import Cores

COMPUTE_THREAD = "compute"


class ComputeStream:
    def __init__(self, env: simpy.Environment, cores: Cores | None, lazy: bool,
                 sync_s: float = 0.0) -> None:
        self.env = env
        self.cores = cores  # None: an accelerator with its own time
        self.lazy = lazy
        self.sync_s = sync_s
        self.queue: simpy.Store = simpy.Store(env)
        self.held: list[tuple[float, simpy.Event]] = []  # lazy work not handed over yet
        self.last: simpy.Event = env.event().succeed()  # completion of the newest item
        self.busy_s = 0.0
        self.running = False
        self.pending = 0  # items handed over and not finished
        env.process(self._run())

    def submit(self, seconds: float, lazy: bool | None = None) -> simpy.Event:
        """Queue `seconds` of compute; with lazy evaluation it waits for the next sync."""
        done = self.env.event()
        if self.lazy if lazy is None else lazy:
            self.held.append((seconds, done))
        else:
            self._hand_over(seconds, done)
        self.last = done
        return done

    def sync(self) -> simpy.Event:
        """The host waits for everything queued so far (lazy work is handed over now)."""
        if self.held or (self.sync_s and (self.pending or self.running)):
            held, self.held = self.held, []
            for seconds, done in held:
                self._hand_over(seconds, done)
            if self.sync_s:
                done = self.env.event()
                self._hand_over(self.sync_s, done)
                self.last = done
        return self.last

    def _hand_over(self, seconds: float, done: simpy.Event) -> None:
        self.pending += 1
        self.queue.put((seconds, done))

    def _run(self):
        while True:
            seconds, done = yield self.queue.get()
            self.running = True
            if self.cores is None:
                yield self.env.timeout(seconds)
            else:
                yield self.cores.work(seconds, COMPUTE_THREAD)
            self.busy_s += seconds
            self.pending -= 1
            self.running = False
            done.succeed()
