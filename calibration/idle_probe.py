"""Idle probe: how much slower the engine steps after the process has idled.

The engine decodes with every expert in the page cache, a sleep injected after every
`every`-th decode step (an idle spell, as a read throttle's stall makes one), against the same
run without; arms rotated over rounds, each capture its own process, which reads every
thread's /proc/self/task/*/schedstat from its first decode step to its exit (as
calibration.stall_probe). Both decode loops, each with the preset that runs it
(calibration.stall_probe.LOOP_PRESETS: hot for the lookahead loop, on-demand for the
synchronous one).

What it showed on this project's 2-core VM (reports/validation/idle_probe.json): after 60 ms
sleeps both busy threads' run-queue waits and timeslices grow several-fold and the steps right
after a sleep slow down, more the more often the process sleeps; 20 ms sleeps cost nothing.
Pinned to separate cores (a scratch run) the threads lose most of it: the kernel places a
waking thread by its recent utilization (sim.idle_slowdown), and threads that slept long look
small and share a core.

The curve (hardware `idle_util_points` -> `idle_slowdown`, `sync_` keys for the synchronous
loop): for each sleeping arm and each of the RECOVERY steps after a sleep, the kernel's 32 ms
average of "a thread of the process runs" at that step (1 while stepping, 0 while asleep,
followed through the capture's own timeline) and the step's slowdown: its build + eval over
the median of the same capture's steps further from any sleep (a capture alternates blocks of
BLOCK steps with and without sleeps, so the reference runs in the same minute: on this shared
machine a capture a minute later can run 20% faster or slower). A point is the median over
every round's steps at that arm and position, made non-increasing in the average (pool-
adjacent-violators weighted by steps) and ended, at no slowdown, by the first that does not
stand out of the far steps' own scatter by Z standard errors of its median (noise; never less
than NOISE): a point of few steps must be larger to count.

    curves = measure_idle_slowdown(Path("models/tiny-trained-stream"))  # lookahead, sync

Linux only (schedstat); returns None elsewhere. Never imports MLX here: the captures do, in
their own processes.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from calibration.probe_capture import CaptureSpec, thread_stats
from calibration.stall_probe import LOOP_PRESETS, per_step
from contract.errors import IOFault
from sim.idle_slowdown import IdleSlowdown

# (sleep ms, every n decode steps): a throttle's ~70 ms stall every ~3 steps, and spells
# that leave the average room to recover in between; (0, 0) sleeps never (its threads'
# figures are the table's reference)
ARMS = ((0.0, 0), (60.0, 3), (60.0, 8), (20.0, 3))
BLOCK = 24  # decode steps: a capture alternates a block with sleeps and a block without
RECOVERY = 8  # steps after a sleep that make points; the later ones are the reference
# A slowdown this small is not told apart from the reference: fully recovered steps scatter
# this much (reports/validation/idle_probe.json); the curve ends there.
NOISE = 0.05
# ... nor one under Z standard errors of its median: single steps scatter 12-50% here (a
# scratch reading of the 20:21 UTC probe's captures: sigma from the far steps' MAD), and a
# point of one step per capture (steps 3-8 after a sleep every 3 steps) made the curve's tail
# (+7..+10% at averages 0.72-0.88 in one run, none in another)
Z = 2.0
ROUNDS = 3


def sleeps_after(count: int, every: int) -> bool:
    """Whether the probe sleeps after the `count`-th decode step (1-based): every `every`
    steps inside the even blocks. The sleep falls inside the next step's window."""
    return every > 0 and ((count - 1) // BLOCK) % 2 == 0 and count % every == 0


def since_sleep(steps: int, every: int) -> list[int | None]:
    """Per decode step (0-based) the steps since the last one with a sleep at its start (0:
    it has one; None: none yet)."""
    out: list[int | None] = []
    last = None
    for i in range(steps):
        if i and sleeps_after(i, every):
            last = i
        out.append(None if last is None else i - last)
    return out


@dataclass
class IdleRun:
    """One capture: its decode rows in order and the two busy threads' figures per step."""

    sleep_ms: float
    every: int
    trace: Path
    rows: list[tuple[int, int, int]]  # (start_ns, end_ns, build + eval ns) per decode step
    threads: dict[str, dict[str, float]]  # "main" / "compute" -> run_ms, runqueue_ms, switches


@dataclass
class IdleCurve:
    util: list[float]
    slowdown: list[float]
    rounds: int
    preset: str
    points: list[dict[str, float]] = field(default_factory=list)  # before pooling
    runs: list[IdleRun] = field(default_factory=list)


def child(spec: CaptureSpec, sleep_ms: float, every: int) -> int:
    """A capture that sleeps after every `every`-th decode step; the threads' statistics
    from the first decode step on."""
    from calibration.probe_capture import run

    seen = [0]
    first: dict[str, dict[str, float]] = {}

    def sleepy(row: dict) -> None:
        if row.get("phase") == "decode":
            seen[0] += 1
            if seen[0] == 1:  # decode's own figures: loading and the first prefill left out
                first.update(thread_stats())
            if sleep_ms > 0 and sleeps_after(seen[0], every):
                time.sleep(sleep_ms / 1e3)

    def since_first() -> dict[str, dict[str, float]]:
        now = thread_stats()
        return {t: {k: v - first.get(t, {}).get(k, 0.0) for k, v in s.items()}
                for t, s in now.items()}

    run(spec, on_step=sleepy, stats=since_first)
    return 0


def capture(model_dir: Path, sleep_ms: float, every: int, out: Path, *, tokens: int,
            preset: str) -> IdleRun:
    import polars as pl

    from traces.reader import read_trace

    stats = out.parent / f"{out.name}.sched.json"
    spec = CaptureSpec(str(model_dir), str(out), str(stats), tokens, preset)
    proc = subprocess.run([sys.executable, "-m", "calibration.idle_probe", spec.to_json(),
                           str(sleep_ms), str(every)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0 or not stats.is_file():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise IOFault(f"{model_dir}: idle probe capture (sleep {sleep_ms} ms every {every}) "
                      f"failed: {tail}")
    steps = read_trace(out).steps.filter(pl.col("phase") == "decode").sort("step")
    rows = list(zip(steps["start_ns"].to_list(), steps["end_ns"].to_list(),
                    (steps["build_ns"] + steps["eval_ns"]).to_list(), strict=True))
    return IdleRun(sleep_ms, every, out, rows, per_step(json.loads(stats.read_text()),
                                                        len(rows)))


def run_arms(model_dir: Path, rounds: int, work: Path, *, tokens: int,
             preset: str) -> list[IdleRun]:
    """Every arm captured `rounds` times, the order rotated per round."""
    runs = []
    arms = list(ARMS)
    for r in range(rounds):
        for sleep_ms, every in arms[r % len(arms):] + arms[:r % len(arms)]:
            runs.append(capture(model_dir, sleep_ms, every,
                                work / f"{preset}-sleep{sleep_ms:g}-every{every}-round{r}",
                                tokens=tokens, preset=preset))
    return runs


def utilization(run: IdleRun) -> list[float]:
    """The simulator's average (sim.idle_slowdown.IdleSlowdown, so the curve's x is what the
    sim keeps) at the middle of each decode step: a thread runs while stepping (one of the two
    busy threads always does), none through a sleep (at the start of the step after a sleeping
    one: the recorder sleeps after that step's row)."""
    average = IdleSlowdown("idle probe", [], [])
    now, out = 0.0, []
    for i, (start, end, _) in enumerate(run.rows):
        span = (end - start) / 1e9
        asleep = min(run.sleep_ms / 1e3 if i and sleeps_after(i, run.every) else 0.0, span)
        average.advance(now + asleep, False)
        average.advance(now + asleep + (span - asleep) / 2, True)
        out.append(average.util)
        now += span
        average.advance(now, True)
    return out


def pooled(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """(u, slowdown, steps) sorted by u and made non-increasing in slowdown (weighted
    pool-adjacent-violators: a violating run is replaced by its steps-weighted mean, at its
    weighted mean u, and counts all their steps)."""
    blocks: list[list[float]] = []  # [sum u*n, sum slowdown*n, n]
    for u, y, n in sorted(points):
        blocks.append([u * n, y * n, n])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] < blocks[-1][1] / blocks[-1][2]:
            su, sy, sn = blocks.pop()
            blocks[-1][0] += su
            blocks[-1][1] += sy
            blocks[-1][2] += sn
    return [(su / n, sy / n, int(n)) for su, sy, n in blocks]


def run_steps(run: IdleRun) -> tuple[dict[int, list[tuple[float, float]]], list[float]]:
    """Position after a sleep (1..RECOVERY) -> (the average, the step's build + eval over the
    median of the same capture's steps further from any sleep, less 1) for each such step; and
    the same ratio, less 1, for each of those far steps (the reference's own scatter)."""
    after = since_sleep(len(run.rows), run.every)
    util = utilization(run)
    ref = [run.rows[i][2] for i, p in enumerate(after) if p is not None and p > RECOVERY]
    if not ref:
        return {}, []
    base = statistics.median(ref)
    out: dict[int, list[tuple[float, float]]] = {}
    for i, p in enumerate(after):
        if p is not None and 1 <= p <= RECOVERY:
            out.setdefault(p, []).append((util[i], run.rows[i][2] / base - 1))
    return out, [w / base - 1 for w in ref]


def noise(scatter: list[float], steps: int) -> float:
    """The smallest slowdown a median of `steps` steps tells apart from none: Z standard
    errors of a median (1.2533 sigma / sqrt(n), sigma from the far steps' MAD), and never
    under NOISE."""
    if not scatter or steps < 1:
        return NOISE
    mid = statistics.median(scatter)
    sigma = 1.4826 * statistics.median(abs(x - mid) for x in scatter)
    return max(NOISE, Z * 1.2533 * sigma / math.sqrt(steps))


def curve(runs: list[IdleRun], rounds: int, preset: str) -> IdleCurve:
    """Per sleeping arm and position after the sleep, the steps of every round pooled: their
    median average and median slowdown (run_steps). The curve: those points made
    non-increasing (weighted by steps), ended, at no slowdown, by the first that does not
    stand out of the far steps' scatter (noise)."""
    raw: dict[tuple[float, int, int], list[tuple[float, float]]] = {}
    scatter: list[float] = []
    for r in runs:
        if r.every:
            steps, far = run_steps(r)
            scatter += far
            for pos, at in steps.items():
                raw.setdefault((r.sleep_ms, r.every, pos), []).extend(at)
    points = [{"sleep_ms": k[0], "every": k[1], "position": k[2],
               "util": statistics.median(u for u, _ in v),
               "slowdown": statistics.median(y for _, y in v), "steps": len(v)}
              for k, v in sorted(raw.items())]
    if not points:
        raise IOFault("idle probe: no step after a sleep was captured")
    util, slow = [], []
    blocks = pooled([(p["util"], p["slowdown"], p["steps"]) for p in points])
    for u, y, n in [*blocks, (1.0, 0.0, 1)]:
        if not util or u > util[-1] + 1e-4:
            util.append(round(u, 4))
            slow.append(round(y, 4) if y >= noise(scatter, n) else 0.0)
            if slow[-1] == 0:  # flat from here (the curve's end value)
                break
    return IdleCurve(util, slow, rounds, preset, points, runs)


def measure_idle_slowdown(model_dir: Path, *, rounds: int = ROUNDS,
                          tokens: int = 4 * BLOCK) -> dict[str, IdleCurve] | None:
    """The probe on `model_dir`, one curve per decode loop ("lookahead", "sync", each with
    the preset that runs it: calibration.stall_probe.LOOP_PRESETS); None where there is no
    schedstat (not Linux)."""
    if not Path("/proc/self/schedstat").is_file():
        return None
    out = {}
    with tempfile.TemporaryDirectory(prefix="ssdmoe-idle-") as tmp:
        for loop, preset in LOOP_PRESETS.items():
            runs = run_arms(Path(model_dir).resolve(), rounds, Path(tmp), tokens=tokens,
                            preset=preset)
            out[loop] = curve(runs, rounds, preset)
    return out


if __name__ == "__main__":  # a probe capture: SPEC_JSON SLEEP_MS EVERY
    sys.exit(child(CaptureSpec.from_json(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])))
