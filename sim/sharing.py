"""Processor sharing: jobs in service together, each progressing at `rate(n)` seconds of work
per second while n jobs are in service: the host's cores (sim.cpu). A server whose jobs
are not served alike overrides `rates()`.

A job is `yield server.work(seconds, who)`: the event fires when the job has had `seconds` of
work. Arrivals and departures re-time the one pending completion (a generation number retires
stale timers), so a job costs one event whatever the contention.
"""

from __future__ import annotations

from collections import defaultdict

import simpy

EPS_S = 1e-12


class ProcessorSharing:
    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.jobs: dict[int, list] = {}  # id -> [remaining s, event, who]
        self._next_id = 0
        self._at = 0.0  # time `remaining` was last brought up to date
        self._generation = 0
        self.busy_s: dict[str, float] = defaultdict(float)  # work seconds per `who`

    def rate(self, n: int) -> float:
        """Work seconds per second each of n jobs in service gets (<= 1)."""
        raise NotImplementedError

    def rates(self) -> dict[int, float]:
        """Work seconds per second of each job in service (by default all alike)."""
        rate = self.rate(len(self.jobs))
        return dict.fromkeys(self.jobs, rate)

    def on_elapsed(self, elapsed: float, n: int) -> None:
        """Hook: `elapsed` seconds passed with n jobs in service."""

    def work(self, seconds: float, who: str = "main") -> simpy.Event:
        """An event that fires once `who` has had `seconds` of work."""
        self.busy_s[who] += seconds
        if seconds <= 0:
            return self.env.timeout(0.0)
        self._update()
        done = self.env.event()
        self._next_id += 1
        self.jobs[self._next_id] = [seconds, done, who]
        self._schedule()
        return done

    def _update(self) -> None:
        """Charge the work given since the last update to every job in service."""
        now = self.env.now
        elapsed = now - self._at
        if elapsed > 0 and self.jobs:
            self.on_elapsed(elapsed, len(self.jobs))
            rates = self.rates()
            for key, job in self.jobs.items():
                job[0] -= elapsed * rates[key]
        self._at = now

    def _schedule(self) -> None:
        # finish every job that is done, then time the next completion
        for key in [k for k, job in self.jobs.items() if job[0] <= EPS_S]:
            self.jobs.pop(key)[1].succeed()
        if not self.jobs:
            return
        self._generation += 1
        generation = self._generation
        rates = self.rates()
        soonest = min(job[0] / rates[key] for key, job in self.jobs.items() if rates[key] > 0)
        timer = self.env.timeout(soonest)
        timer.callbacks.append(lambda _event: self._fire(generation))

    def _fire(self, generation: int) -> None:
        if generation != self._generation:
            return  # re-timed by a later arrival or departure
        self._update()
        self._schedule()
