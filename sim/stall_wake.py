"""Waking after a stall: a thread that slept while the main thread was blocked on a fill's loads
waits for a core before it runs again.

Measured on this project's 2-core VM (calibration.stall_probe, /proc schedstat): with each
expert read held longer, the main thread's and MLX's compute thread's CPU time per step stay
the same, but the time each spends runnable and not running grows, and the measured eval grows
with the compute thread's share. The growth per fill rises with the stall and levels off
(a stall of ~1.5 ms costs ~0.3 ms, one of ~12 ms ~1 ms), so the hardware profile holds it as a
curve: `stall_points_ms` (a fill's time blocked) -> `stall_wake_main_ms` (the main thread's
wait, blocked time) and `stall_wake_compute_ms` (the compute thread's, before the next work
it is handed: sim.compute_stream), linear from (0, 0) through the points and flat after the
last. An empty curve (the paper's machines: nothing measured) costs nothing.

Each decode loop has its own curve (`for_loop`): the probe runs the lookahead loop (hardware
`stall_*` keys) and the synchronous one (`sync_stall_*`). Both bend the same way on the 2-core
VM: a fill's stall of up to ~1-1.5 ms costs no wait at all, ~3-5 ms costs the compute thread
~0.7 ms, so the curve is measured where it bends rather than drawn from the origin. In the
synchronous loop the threads' run-queue waits land only partly on the step, so its curve holds
what the step's build and eval grew by (calibration.stall_probe.LOOP_WAITS).

The curve is read at the stall's idle part (sim.main_thread._blocked): the time the main thread
was blocked with no thread of the process running on the host's cores (sim.cpu.Cores.active_s).
The probe's stalls are sleeps (nothing runs); a cold read that the main thread or a reader does
itself keeps the host busy for most of its time (cold_read_cpu_ms), and the synchronous loop's
evaluation did not grow with cold reads at all (on demand with every expert cached, half or a
quarter of them: 8.35, 8.42, 8.20 ms a step, the 17:36 run), where the curve read at the whole
blocked time charged it 1.2-2.1 ms more.

A stall the host spends busy costs the compute thread too, in the lookahead loop, though not as
a wait for a core: reports/validation/busy_stall_probe.py held every expert read busy (the
reading thread re-reading warm pages, the GIL let go per pread) and eval grew 0.05-0.15 ms per
fill with the compute thread's run-queue wait flat, where a sleep of the same length grew it
0.17-0.76. The hardware's `busy_stall_points_ms` -> `busy_stall_compute_ms` (calibration's
busy hold) is read at the stall's busy part (its blocked time less the idle part), linear from
(0, 0) and flat after the last point; the synchronous loop has none (its evaluation did not
grow with cold reads, above)."""

from __future__ import annotations

from contract.errors import BadInput
from sim.piecewise import linear
from sim.scenario import Hardware


class StallWake:
    def __init__(self, where: str, points_ms: list[float], main_ms: list[float],
                 compute_ms: list[float], busy_points_ms: list[float] | None = None,
                 busy_compute_ms: list[float] | None = None) -> None:
        busy_points_ms, busy_compute_ms = busy_points_ms or [], busy_compute_ms or []
        if len(busy_points_ms) != len(busy_compute_ms):
            raise BadInput(f"{where}: busy_stall_compute_ms has {len(busy_compute_ms)} values "
                           f"for {len(busy_points_ms)} busy_stall_points_ms: one per point")
        self._busy = [0.0, *(p / 1e3 for p in busy_points_ms)]
        self.busy_compute = [0.0, *(v / 1e3 for v in busy_compute_ms)]
        if not points_ms and (main_ms or compute_ms):
            raise BadInput(f"{where}: stall_wake_main_ms / stall_wake_compute_ms need "
                           "stall_points_ms (the stalls they were measured at)")
        for name, values in (("stall_wake_main_ms", main_ms),
                             ("stall_wake_compute_ms", compute_ms)):
            if points_ms and len(values) != len(points_ms):
                raise BadInput(f"{where}: {name} has {len(values)} values for "
                               f"{len(points_ms)} stall_points_ms: one per point")
        self.points = [p / 1e3 for p in points_ms]
        # each curve starts at (0, 0): no stall, no wait
        self._stalls = [0.0, *self.points]
        self.main = [0.0, *(v / 1e3 for v in main_ms)]
        self.compute = [0.0, *(v / 1e3 for v in compute_ms)]

    @classmethod
    def for_loop(cls, hw: Hardware, lookahead: bool) -> StallWake:
        """The curve measured in the decode loop the scenario runs."""
        prefix = "" if lookahead else "sync_"
        busy = (hw.busy_stall_points_ms, hw.busy_stall_compute_ms) if lookahead else ([], [])
        return cls(f"hardware {hw.name}", *(getattr(hw, f"{prefix}{key}") for key in (
            "stall_points_ms", "stall_wake_main_ms", "stall_wake_compute_ms")), *busy)

    def _at(self, curve: list[float], stall_s: float) -> float:
        if not self.points:
            return 0.0
        return linear(self._stalls, curve, stall_s)

    def main_wait(self, stall_s: float) -> float:
        return self._at(self.main, stall_s)

    def compute_wait(self, stall_s: float) -> float:
        return self._at(self.compute, stall_s)

    @property
    def reads_idle(self) -> bool:
        """Whether either curve needs a stall's idle part (its busy part is the rest)."""
        return bool(self.points) or len(self._busy) > 1

    def busy_compute_wait(self, busy_s: float) -> float:
        """The compute thread's extra time after a stall with `busy_s` of it spent busy."""
        if len(self._busy) < 2 or busy_s <= 0:
            return 0.0
        return linear(self._busy, self.busy_compute, busy_s)
