"""Running slow after idling: while the process has recently been mostly idle, its threads take
longer for the same work.

Measured on this project's 2-core VM (calibration.idle_probe): the engine decoding with every
expert cached, a sleep injected every few decode steps (an idle spell like a read throttle's
stall) against none. After the sleeps the main thread's and MLX's compute thread's run-queue
waits and timeslices grow several-fold (the scheduler runs the woken threads on one core;
pinned to separate cores they lose most of it) and each step's evaluation slows: a 60 ms
sleep every 3 steps ~1.5x, every 8 steps ~1.2x in the two steps after it and nothing in the
rest. The kernel places a waking thread by its recent utilization (PELT: a geometric average
of running time whose weight halves every 32 ms, kernel/sched/pelt.c): threads that slept
look small and are packed together until their averages recover.

The model keeps such an average, `util`: the share of time any of the process's threads ran
(1 while something runs, 0 while all wait), decayed with the kernel's half-life; CPU work
started at `util` costs its seconds times 1 + slowdown(util), a curve the probe measures
(hardware `idle_util_points` -> `idle_slowdown`, linear between points, the end values beyond
them). The factor is fixed at a job's start: jobs last ~0.01-1 ms against a 32 ms half-life.
Each decode loop has its own curve (`for_loop`, hardware keys prefixed `sync_` for the
synchronous loop): there the main thread waits while the compute thread runs, so threads
packed on one core lose less. An empty curve (the paper's machines: nothing measured) costs
nothing.
"""

from __future__ import annotations

import math

from contract.errors import BadInput
from sim.piecewise import linear
from sim.scenario import Hardware

PELT_HALF_LIFE_MS = 32.0  # kernel/sched/pelt.c: y^32 = 0.5 with 1024 us periods


class IdleSlowdown:
    def __init__(self, where: str, util_points: list[float], slowdown: list[float],
                 half_life_ms: float = PELT_HALF_LIFE_MS) -> None:
        if len(util_points) != len(slowdown):
            raise BadInput(f"{where}: idle_slowdown has {len(slowdown)} values for "
                           f"{len(util_points)} idle_util_points: one per point")
        self.points = list(util_points)
        self.slowdown = list(slowdown)
        self.tau = half_life_ms / 1e3 / math.log(2)  # e-folding time of the average (s)
        self.util = 1.0  # a process starts as if busy: nothing slows before it has idled
        self._at = 0.0

    @classmethod
    def for_loop(cls, hw: Hardware, lookahead: bool) -> IdleSlowdown:
        """The curve measured in the decode loop the scenario runs."""
        prefix = "" if lookahead else "sync_"
        return cls(f"hardware {hw.name}", getattr(hw, f"{prefix}idle_util_points"),
                   getattr(hw, f"{prefix}idle_slowdown"))

    @property
    def enabled(self) -> bool:
        return bool(self.points)

    def advance(self, now: float, running: bool) -> None:
        """Whether any thread ran since the last call."""
        dt = now - self._at
        if dt > 0:
            keep = math.exp(-dt / self.tau)
            self.util = self.util * keep + (1.0 - keep) * running
        self._at = now

    def factor(self) -> float:
        """CPU seconds a job started now takes per second of work."""
        if not self.points:
            return 1.0
        return 1.0 + linear(self.points, self.slowdown, self.util)
