"""Stall probe: what a thread pays to run again after the main thread blocked on loads.

The engine decodes with every expert in the page cache, each expert read held for an injected
delay (a sleep before the store's read, on whichever thread reads: a slow device with the device
itself left out), against the same run with no delay, arms rotated over rounds. Each capture is
its own process; at its exit the kernel's per-thread scheduler statistics
(/proc/self/task/*/schedstat: CPU time, time runnable but waiting for a core, timeslices) are
read for the main thread and for MLX's compute thread (the other thread with the most CPU).
Both decode loops are probed, each with the preset that runs it (LOOP_PRESETS): hot in the
lookahead loop, on-demand (exact) in the synchronous one.

Why it is a curve (reports/validation/stall_probe.json): the compute thread's CPU per step
does not change with the delay, but its run-queue wait grows with the main thread's blocked
time, and so does the main thread's; the measured eval grows with the compute thread's wait.
Per fill that blocked (a layer's loads waited for), the growth of each
thread's wait against the growth of the fill's blocked time, one point per delay, is the curve
the simulator takes (hardware `stall_points_ms`, `stall_wake_main_ms`, `stall_wake_compute_ms`
for the lookahead loop, the same keys prefixed `sync_` for the synchronous one, where the waits
are what the step's build and eval grew by: LOOP_WAITS; sim.stall_wake). The curve bends:
short stalls cost no wait, long ones do; so the delays start small, where a line from the
origin to a first point at a long stall would charge short stalls (unthrottled cold reads) a
wake they do not pay.

    curves = measure_stall_wake(Path("models/tiny-trained-stream"))  # lookahead, sync

Linux only (schedstat); `measure_stall_wake` returns None elsewhere. Never imports MLX here:
the captures do, in their own processes.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from calibration.probe_capture import CaptureSpec
from contract.errors import IOFault

# The engine preset each decode loop is probed with: hot runs the lookahead loop (fills at fill
# points, every load waited for at a fill), on-demand (exact) the synchronous loop (the router
# syncs while the graph is built, each routed bundle read on the main thread).
LOOP_PRESETS = {"lookahead": "hot", "sync": "on-demand"}
# What each loop's curve takes as the waits (curve_point). In the lookahead loop the threads'
# run-queue waits: replayed, they give the probe's own eval. In the synchronous loop they land
# only partly on the step (the compute thread, woken per operation while the main thread still
# dispatches, waits mostly beside it), so there the curve takes what the step grew by: build
# (the main thread's share, where the sim books its wait) and eval (the compute thread's).
LOOP_WAITS = {"lookahead": "runqueue", "sync": "step"}
DELAYS_MS = (0.2, 0.5, 1.0, 4.0)
# How a read is held: "sleep" (a slow device: the thread idles) or "busy" (the reading thread
# keeps a core busy copying warm pages, its GIL let go on every pread, as a cold read's kernel
# work does: reports/validation/busy_stall_probe.py)
HOLDS = ("sleep", "busy")
BUSY_CHUNK = 65536  # bytes per pread of the busy hold
# the busy holds calibrate runs in the lookahead loop (a cold read's ~0.5-1 ms of kernel work):
# their eval growth per fill is the busy curve (sim.stall_wake)
BUSY_DELAYS_MS = (0.5, 1.0)


@dataclass
class StallRun:
    """One capture: decode split per step and the two threads' scheduler figures per step."""

    delay_ms: float
    trace: Path
    steps: int
    build_ms: float
    eval_ms: float
    blocked_ms: float
    fills: float  # fills per step that waited on a load (distinct layers with a waited load)
    threads: dict[str, dict[str, float]]  # "main" / "compute" -> run_ms, runqueue_ms, switches
    hold: str = "sleep"  # HOLDS


@dataclass
class StallCurve:
    """Per fill that blocked: the stall (ms) and each thread's wait for a core (ms) beyond the
    no-delay run's, one point per injected delay."""

    stall_ms: list[float]
    main_ms: list[float]
    compute_ms: list[float]
    delays_ms: list[float]
    rounds: int
    preset: str = LOOP_PRESETS["lookahead"]
    runs: list[StallRun] = field(default_factory=list)
    busy_stall_ms: list[float] = field(default_factory=list)  # the busy holds' stalls per
    busy_compute_ms: list[float] = field(default_factory=list)  # fill and eval grown per fill
    busy_delays_ms: list[float] = field(default_factory=list)


def child(spec: CaptureSpec, delay_ms: float, hold: str = "sleep") -> int:
    """A capture with every expert read held `delay_ms` as it ends (asleep, or busy
    re-reading the first BUSY_CHUNK of the model's resident file, warm)."""
    import os

    from calibration.probe_capture import run

    warm = os.open(Path(spec.model) / "resident.safetensors", os.O_RDONLY) \
        if hold == "busy" else -1

    def held() -> None:
        if hold == "busy":
            end = time.perf_counter() + delay_ms / 1e3
            while time.perf_counter() < end:
                os.pread(warm, BUSY_CHUNK, 0)
        else:
            time.sleep(delay_ms / 1e3)

    run(spec, read_hook=held if delay_ms > 0 else None)
    return 0


def per_step(stats: dict[str, dict[str, float]], steps: int) -> dict[str, dict[str, float]]:
    """The main thread (its task id is the process id, the lowest) and the compute thread (the
    other with the most CPU), per decode step."""
    stats = dict(stats)
    main = stats.pop(str(min(int(t) for t in stats)))
    compute = max(stats.values(), key=lambda s: s["run_ms"])
    return {name: {k: v / steps for k, v in s.items()}
            for name, s in (("main", main), ("compute", compute))}


def capture(model_dir: Path, delay_ms: float, out: Path, *, tokens: int,
            prompts: Path | None = None, preset: str = LOOP_PRESETS["lookahead"],
            hold: str = "sleep") -> StallRun:
    import polars as pl

    from traces.reader import read_trace

    stats = out.parent / f"{out.name}.sched.json"
    spec = CaptureSpec(str(model_dir), str(out), str(stats), tokens, preset,
                       None if prompts is None else str(prompts))
    proc = subprocess.run([sys.executable, "-m", "calibration.stall_probe", spec.to_json(),
                           str(delay_ms), hold], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0 or not stats.is_file():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise IOFault(f"{model_dir}: stall probe capture (delay {delay_ms} ms) failed: {tail}")
    trace = read_trace(out)
    steps = trace.steps.filter(pl.col("phase") == "decode")
    waited = trace.loads.filter(pl.col("step").is_in(steps["step"].implode())
                                & pl.col("waited") & (pl.col("wait_ns") > 0))
    fills = waited.select(["step", "layer"]).unique().height / max(steps.height, 1)
    ms = {k: steps[k].mean() / 1e6 for k in ("build_ns", "eval_ns", "blocked_ns")}
    return StallRun(delay_ms, out, steps.height, ms["build_ns"], ms["eval_ns"],
                    ms["blocked_ns"], fills, per_step(json.loads(stats.read_text()),
                                                      steps.height), hold)


def run_arms(model_dir: Path, delays: list[float], rounds: int, work: Path, *, tokens: int,
             prompts: Path | None = None, preset: str = LOOP_PRESETS["lookahead"],
             hold: str = "sleep") -> list[StallRun]:
    """Every delay captured `rounds` times, the order rotated per round."""
    runs = []
    for r in range(rounds):
        for d in delays[r % len(delays):] + delays[:r % len(delays)]:
            runs.append(capture(model_dir, d, work / f"{preset}-{hold}{d}-round{r}",
                                tokens=tokens, prompts=prompts, preset=preset, hold=hold))
    return runs


def curve_point(runs: list[StallRun], delay_ms: float,
                waits_from: str = "runqueue") -> tuple[float, float, float]:
    """(stall, main wait, compute wait) ms per fill that blocked, each the growth over the
    no-delay arm: medians over rounds, the arms paired in round order. The waits are the
    threads' run-queue waits (`waits_from` "runqueue"), or what the step's components grew by
    ("step": build for the main thread, eval for the compute thread; see LOOP_WAITS)."""
    base = [r for r in runs if r.delay_ms == 0]
    held = [r for r in runs if r.delay_ms == delay_ms]
    points: list[tuple[float, float, float]] = []
    for b, h in zip(base, held, strict=True):
        if h.fills <= 0 or h.blocked_ms <= b.blocked_ms:
            continue
        stall = h.blocked_ms / h.fills - (b.blocked_ms / b.fills if b.fills else 0.0)
        if waits_from == "step":
            grown = [h.build_ms - b.build_ms, h.eval_ms - b.eval_ms]
        else:
            grown = [h.threads[t]["runqueue_ms"] - b.threads[t]["runqueue_ms"]
                     for t in ("main", "compute")]
        points.append((stall, *(max(g, 0.0) / h.fills for g in grown)))
    if not points:
        raise IOFault(f"stall probe: a {delay_ms} ms delay did not lengthen the fills' "
                           "blocked time")
    return tuple(statistics.median(p[i] for p in points) for i in range(3))  # type: ignore


def curve(runs: list[StallRun], delays_ms: tuple[float, ...], rounds: int,
          preset: str, waits_from: str = "runqueue") -> StallCurve:
    """The points of every delay in order of stall (a noisy round can give a longer delay
    less stall); of points with the same stall the first stays, since the curve needs
    distinct stalls."""
    points: list[tuple[float, float, float]] = []
    for p in sorted(curve_point(runs, d, waits_from) for d in delays_ms):
        if not points or p[0] > points[-1][0]:
            points.append(p)
    return StallCurve([p[0] for p in points], [p[1] for p in points],
                      [p[2] for p in points], list(delays_ms), rounds, preset, runs)


def measure_stall_wake(model_dir: Path, *, delays_ms: tuple[float, ...] = DELAYS_MS,
                       busy_delays_ms: tuple[float, ...] = BUSY_DELAYS_MS,
                       rounds: int = 2, tokens: int = 24) -> dict[str, StallCurve] | None:
    """The probe on `model_dir`, one curve per decode loop ("lookahead", "sync"), the
    lookahead one with its busy holds' curve too; None where there is no schedstat (not
    Linux)."""
    if not Path("/proc/self/schedstat").is_file():
        return None
    out = {}
    model_dir = Path(model_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="ssdmoe-stall-") as tmp:
        for loop, preset in LOOP_PRESETS.items():
            runs = run_arms(model_dir, [0.0, *delays_ms], rounds, Path(tmp), tokens=tokens,
                            preset=preset)
            out[loop] = curve(runs, delays_ms, rounds, preset, LOOP_WAITS[loop])
        if busy_delays_ms:
            preset = LOOP_PRESETS["lookahead"]
            busy = run_arms(model_dir, [0.0, *busy_delays_ms], rounds, Path(tmp),
                            tokens=tokens, preset=preset, hold="busy")
            # what eval grew by per fill ("step"): the compute thread's run-queue wait stays
            # flat beside a busy hold (reports/validation/busy_stall_probe.py)
            held = curve(busy, busy_delays_ms, rounds, preset, "step")
            found = out["lookahead"]
            found.busy_stall_ms, found.busy_compute_ms = held.stall_ms, held.compute_ms
            found.busy_delays_ms = list(busy_delays_ms)
            found.runs += busy
    return out


if __name__ == "__main__":  # a probe capture: SPEC_JSON DELAY_MS HOLD
    sys.exit(child(CaptureSpec.from_json(sys.argv[1]), float(sys.argv[2]), sys.argv[3]))
