"""The accelerator's command stream (MLX's compute thread): work the main thread queues runs in
order, one item at a time.

  on an accelerator (Metal)   an item takes its duration of device time
  on a CPU backend            an item is CPU work on the host's cores (sim.cpu), so it slows
                              down when graph building and readers run beside it
  lazy                        MLX evaluates lazily: in the synchronous decode loop and at
                              prefill, queued work starts only at the next host sync (`sync`)
  sync overhead               a sync that finds work queued or running costs the stream
                              `sync_s` more (handing work over and waking the waiter)
  bounded queue               a non-blocking hand-over (`submit_async`, MLX's async_eval) returns
                              only once at most `queue_ahead_s` of queued work is left: MLX's
                              eval blocks the caller while more than MAX_ACTIVE_TASKS (10) tasks
                              are in flight, and on its CPU backend a task is one operation, so
                              the host runs only a few operations ahead (on Metal a task is a
                              command buffer of many: unbounded, `queue_ahead_s` None). The
                              compute left is what those operations take: a hand-over may
                              give its own (`ahead`: a layer's experts end in a few large
                              operations, a walk to a router in many small ones)

  dispatch wait           on a CPU backend the first `wait` seconds of an item (`submit`'s
                              `wait`) are the compute thread waiting for operations the main
                              thread is still dispatching, no core's time: small operations are
                              dispatched slower than they run (sim.main_thread charges the
                              dispatch's CPU to the main thread while it waits on compute)
  wake-up after a stall the compute thread, idle while the main thread was blocked on a cold
                              load, starts the next work it is handed late (`wake_after`:
                              the scenario's cold_fill_compute_ms, fitted inside decode);
                              only if it is idle by then

`submit` queues an item; `submit_async` queues it and returns the event the host waits on for
the bounded queue (None: no wait); `sync` returns an event that fires when everything queued so
far has run. On a CPU backend the stream is one SimPy process working through the items
handed over (`inflight`, oldest first; its items share the cores). On an accelerator nothing
else shares its time, so an item's finish is known when it is handed over (the later of now and
the previous finish, plus its duration): the stream keeps that timeline and each item is one
timeout. `shortcut=False` runs the process there too; tests/test_sim_cpu.py checks that both
give the same run.
"""

from __future__ import annotations

import math
from collections import deque

import simpy

from sim.cpu import COMPUTE_THREAD, Cores


class ComputeStream:
    def __init__(self, env: simpy.Environment, cores: Cores | None, lazy: bool,
                 sync_s: float = 0.0, shortcut: bool = True,
                 queue_ahead_s: float | None = None) -> None:
        self.env = env
        self.cores = cores  # None: an accelerator with its own time
        self.lazy = lazy
        self.sync_s = sync_s
        self.queue_ahead_s = queue_ahead_s  # None: the host never waits to hand work over
        self.held: list[tuple[float, float]] = []  # lazy (seconds, wait) not handed over yet
        self.last: simpy.Event | None = None  # completion of the newest item handed over
        self.busy_s = 0.0
        # process: [seconds, done] handed over and not finished, oldest first; the first is
        # running once `running` is set (until then it may still be split)
        self.inflight: deque[list] = deque()
        self.running = False
        self._wake: simpy.Event | None = None
        self.timeline = cores is None and shortcut
        self.free_at = 0.0  # timeline: when the accelerator finishes what it was handed
        self.wake_s = 0.0  # run-queue wait before the next work handed to an idle stream
        self.waking_s = 0.0  # total of those waits (not compute: busy_s leaves them out)
        if not self.timeline:
            env.process(self._run())

    def wake_after(self, seconds: float) -> None:
        """The next work handed over starts `seconds` late if the stream is idle by then (its
        thread slept through a main-thread stall and waits for a core to run again)."""
        self.wake_s = max(self.wake_s, seconds)

    def _busy(self) -> bool:
        if self.timeline:
            return self.free_at > self.env.now
        return bool(self.inflight)

    def submit(self, seconds: float, lazy: bool | None = None, wait: float = 0.0) -> None:
        """Queue `seconds` of compute, the first `wait` of them waiting for the main thread's
        dispatch; with lazy evaluation it waits for the next sync."""
        if self.lazy if lazy is None else lazy:
            self.held.append((seconds, wait))
        else:
            self.last = self._hand_over(seconds, wait)

    def submit_async(self, seconds: float, wait: float = 0.0,
                     ahead: float | None = None) -> simpy.Event | None:
        """Queue `seconds` now (never lazy; the first `wait` of them waiting for dispatch), as
        async_eval does: the event the host waits on until at most `queue_ahead_s` of
        everything queued is left, or None (no wait). `ahead`: that bound for this hand-over
        (MLX counts operations, so the compute left depends on what the hand-over ends
        with; inf: the host hands more over before it waits); not where the queue is
        unbounded."""
        q = self.queue_ahead_s
        if q is None or (ahead is not None and math.isinf(ahead)):
            self.last = self._hand_over(seconds, wait)
            return None
        if ahead is not None:
            q = ahead
        if self.timeline:
            self._hand_over(seconds)
            left = self.free_at - q - self.env.now
            return self.env.timeout(left) if left > 0 else None
        if q <= 0:  # a sync in all but name
            self.last = self._hand_over(seconds, wait)
            return self.last
        if seconds > q:  # the point q before the end lies in this item: split it there
            head = self._hand_over(seconds - q, min(wait, seconds - q))
            self.last = self._hand_over(q, max(wait - (seconds - q), 0.0))
            return head
        self.last = self._hand_over(seconds, wait)
        return self._done_when_left(q - seconds)

    def _done_when_left(self, left: float) -> simpy.Event | None:
        """An event for when at most `left` of the work handed over before the newest item
        remains: the waiting item holding that point is split there. A point inside the
        running item is taken as that item's end (the process does not expose its progress:
        late by at most `left`)."""
        items = self.inflight
        first = 1 if self.running else 0
        acc = 0.0
        for i in range(len(items) - 2, -1, -1):
            seconds, done, *waking = items[i]
            if acc + seconds <= left:
                acc += seconds
                continue
            if i < first:
                return done
            tail = left - acc
            point = self.env.event()
            items[i] = [tail, done, *waking]
            items.insert(i, [seconds - tail, point, *waking])
            return point
        return None

    def sync(self) -> simpy.Event | None:
        """The host waits for everything queued so far (lazy work is handed over now): the
        event to wait on, or None when everything has already run."""
        if self.held or (self.sync_s and self._busy()):
            held, self.held = self.held, []
            for seconds, wait in held:
                self.last = self._hand_over(seconds, wait)
            if self.sync_s:
                self.last = self._hand_over(self.sync_s)
        if self.timeline:  # one timeout, to when the accelerator is done; None: it is done
            if self.free_at <= self.env.now:
                return None
            return self.env.timeout(self.free_at - self.env.now)
        if self.last is None or self.last.processed:
            return None
        return self.last

    def _hand_over(self, seconds: float, wait: float = 0.0) -> simpy.Event | None:
        """Queue an item; `wait` (<= seconds) of it first, as a wait for dispatch (a CPU
        backend's: an accelerator's timeline takes the item whole)."""
        wake, self.wake_s = self.wake_s, 0.0
        if self.timeline:  # no event per item: sync reads the timeline
            if self.free_at > self.env.now:
                start = self.free_at
            else:
                start = self.env.now + wake
                self.waking_s += wake
            self.free_at = start + seconds
            self.busy_s += seconds
            return None
        done = self.env.event()
        if wake and not self.inflight:  # idle: the thread waits for a core first
            self.inflight.append([wake, self.env.event(), True])
        wait = min(wait, seconds) if self.cores is not None else 0.0
        if wait > 0:  # runnable once the main thread has dispatched: no core's time
            self.inflight.append([wait, self.env.event(), True])
        self.inflight.append([seconds - wait, done])
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        return done

    def _run(self):
        while True:
            if not self.inflight:
                self._wake = self.env.event()
                yield self._wake
                continue
            seconds, done, *waking = self.inflight[0]
            self.running = True
            if waking:  # runnable, not running: no core's time
                yield self.env.timeout(seconds)
                self.waking_s += seconds
            elif self.cores is None:
                yield self.env.timeout(seconds)
                self.busy_s += seconds
            else:
                if seconds > 0:  # (an empty item is not a job that waits its turn for a core)
                    yield self.cores.work(seconds, COMPUTE_THREAD)
                self.busy_s += seconds
            self.inflight.popleft()
            self.running = False
            done.succeed()
