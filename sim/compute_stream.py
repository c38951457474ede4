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
everything queued so far has run. On a CPU backend the stream is one SimPy process fed by a
Store (its items share the cores). On an accelerator nothing else shares its time, so an item's
finish is known when it is handed over (the later of now and the previous finish, plus its
duration): the stream keeps that timeline and each item is one timeout. `shortcut=False` runs
the process there too; tests/test_sim_cpu.py checks that both give the same run.
"""

from __future__ import annotations

import simpy

from sim.cpu import Cores

COMPUTE_THREAD = "compute"


class ComputeStream:
    def __init__(self, env: simpy.Environment, cores: Cores | None, lazy: bool,
                 sync_s: float = 0.0, shortcut: bool = True) -> None:
        self.env = env
        self.cores = cores  # None: an accelerator with its own time
        self.lazy = lazy
        self.sync_s = sync_s
        self.queue: simpy.Store = simpy.Store(env)
        self.held: list[float] = []  # lazy work not handed over yet
        self.last: simpy.Event | None = None  # completion of the newest item handed over
        self.busy_s = 0.0
        self.running = False
        self.pending = 0  # items handed over and not finished
        self.timeline = cores is None and shortcut
        self.free_at = 0.0  # timeline: when the accelerator finishes what it was handed
        if not self.timeline:
            env.process(self._run())

    def _busy(self) -> bool:
        if self.timeline:
            return self.free_at > self.env.now
        return bool(self.pending or self.running)

    def submit(self, seconds: float, lazy: bool | None = None) -> None:
        """Queue `seconds` of compute; with lazy evaluation it waits for the next sync."""
        if self.lazy if lazy is None else lazy:
            self.held.append(seconds)
        else:
            self.last = self._hand_over(seconds)

    def sync(self) -> simpy.Event | None:
        """The host waits for everything queued so far (lazy work is handed over now): the
        event to wait on, or None when everything has already run."""
        if self.held or (self.sync_s and self._busy()):
            held, self.held = self.held, []
            for seconds in held:
                self.last = self._hand_over(seconds)
            if self.sync_s:
                self.last = self._hand_over(self.sync_s)
        if self.timeline:  # one timeout, to when the accelerator is done; None: it is done
            if self.free_at <= self.env.now:
                return None
            return self.env.timeout(self.free_at - self.env.now)
        if self.last is None or self.last.processed:
            return None
        return self.last

    def _hand_over(self, seconds: float) -> simpy.Event | None:
        if self.timeline:  # no event per item: sync reads the timeline
            start = self.free_at if self.free_at > self.env.now else self.env.now
            self.free_at = start + seconds
            self.busy_s += seconds
            return None
        done = self.env.event()
        self.pending += 1
        self.queue.put((seconds, done))
        return done

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
