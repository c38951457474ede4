"""Core-wait probe: how long a thread back from the device waits for a core while a decoding
engine keeps every core busy.

A cold read is a string of preads, each asleep on the device; each wakes the reading thread,
which then needs a core for the kernel's completion work and the copy. The engine's main and
compute threads sleep and wake thousands of times a second themselves (this machine: ~2,000-
2,500 timeslices a second each, 0.64 and 0.74 of a core in warm decode), so a waking reader
is owed no more than they are and is not run ahead of them: when both cores are busy it waits
in the run queue until one of them blocks. Beside spinning threads it does not wait at all
(calibration.sched_probe), which is why that probe's weight cannot stand for this.

The probe: a thread doing cold reads of a scratch file (9 preads of 8 KiB at random pages,
the file's pages dropped first, FADV_RANDOM; 1 ms asleep before each read, as a reader on its queue)
alone and beside a child process decoding warm (`ssdmoe generate`, the hot preset's
lookahead loop, sampled), arms alternated over rounds. /proc schedstat gives the reading
thread's run-queue wait and wake-ups per read, and the child's threads' CPU share.

The wait per wake beside decode, less alone, is an average over every wake; a wake waits only
when every core is busy, which with the decode's busiest `cores` threads independent happens
u1 x u2 x ... of the time. `core_wait_ms` is that conditional wait: the sim holds a thread
back from the device this long when it finds every core busy (sim.loads).

    found = measure_core_wait(model_dir, scratch_dir)  # CoreWait, or None

Linux only (page drops and schedstat); None elsewhere, on a machine with more cores than the
decode's threads (a wake always finds one free), or when the child does not decode.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from calibration.probe_capture import task_schedstat, thread_stats

READS = 200  # per arm and round
PREADS = 9  # a bundle of the tiny fixture is 9 tensor slices
PREAD_BYTES = 8192
SCRATCH_BYTES = 32 << 20
ROUNDS = 2
CHILD_START_S = 8.0  # the child imports MLX, opens the model and starts decoding


@dataclass
class CoreWait:
    wait_ms: float  # the wait for a core of a wake that finds every core busy
    per_wake_beside_ms: float  # run-queue wait per wake beside the decoding child
    per_wake_alone_ms: float
    wakes_per_read: float
    busy_share: float  # the share of time every core ran one of the child's threads
    thread_shares: list[float]  # the child's busiest threads' cores of CPU
    reads: int  # per arm, over the rounds
    rounds: int


def conditional_wait(beside_ms: float, alone_ms: float, shares: list[float],
                     cores: int) -> float | None:
    """The wait of a wake that finds every core busy: the run-queue wait per wake beside the
    decoding threads less alone, over the chance that the `cores` busiest of them all run
    (independent); None when they are fewer than the cores or never all run."""
    busiest = sorted(shares, reverse=True)[:cores]
    if len(busiest) < cores:
        return None
    busy = math.prod(min(max(s, 0.0), 1.0) for s in busiest)
    if busy <= 0:
        return None
    return max(beside_ms - alone_ms, 0.0) / busy


def core_wait_how(w: CoreWait) -> str:
    """How the figure was measured, for the profile's comment."""
    shares = ", ".join(f"{s:.2f}" for s in w.thread_shares)
    return (f"{w.reads} cold reads of a scratch file per arm, {PREADS} preads of "
            f"{PREAD_BYTES // 1024} KiB each, alone and beside a process decoding warm (hot "
            f"preset), {w.rounds} rounds alternated: run-queue wait per wake "
            f"{w.per_wake_beside_ms:.4f} ms beside, {w.per_wake_alone_ms:.4f} alone, "
            f"{w.wakes_per_read:.1f} wakes a read; the decode's threads ran {shares} of a core, "
            f"every core busy {w.busy_share:.2f} of the time, so a wake that finds them busy "
            "waits (beside - alone) / that share")


def _task_cpu_ms(pid: int) -> dict[str, float]:
    """Task id -> CPU ms so far, for `pid`'s threads."""
    return {task: s["run_ms"] for task, s in thread_stats(pid).items()}


def open_scratch(path: Path) -> int:
    with open(path, "wb") as f:
        f.write(os.urandom(SCRATCH_BYTES))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def read_arm(fd: int, reads: int, seed: int) -> tuple[float, float]:
    """(run-queue wait ms, wake-ups) per cold read of `reads`, on a fresh thread."""
    found: list[tuple[float, float]] = []

    def work() -> None:
        rng = random.Random(seed)
        pages = SCRATCH_BYTES // PREAD_BYTES
        stat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        for _ in range(reads):
            offsets = [rng.randrange(pages) * PREAD_BYTES for _ in range(PREADS)]
            # the whole file: a page range just read is not always dropped (the kernel's
            # per-CPU LRU batches hold it)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            time.sleep(0.001)
            _, wait0, slices0 = task_schedstat(stat)
            for off in offsets:
                os.pread(fd, PREAD_BYTES, off)
            _, wait1, slices1 = task_schedstat(stat)
            found.append((wait1 - wait0, slices1 - slices0))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return (statistics.fmean(w for w, _ in found), statistics.fmean(s for _, s in found))


def _decoder(model_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ssdmoe_cli", "generate", str(model_dir), "--prompt",
         "Once upon a time", "--max-tokens", "20000", "--temp", "1.0", "--preset", "hot",
         "--no-verify"], cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure_core_wait(model_dir: Path, scratch_dir: Path, *, reads: int = READS,
                      rounds: int = ROUNDS, cores: int | None = None) -> CoreWait | None:
    """The probe (module doc) on this machine's cores; None where it cannot tell."""
    if not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"):
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    scratch = Path(scratch_dir) / "core_wait_probe.scratch"
    fd = open_scratch(scratch)
    beside: list[tuple[float, float]] = []
    alone: list[tuple[float, float]] = []
    shares: list[list[float]] = []
    try:
        for r in range(rounds):
            for arm in (("alone", "beside") if r % 2 == 0 else ("beside", "alone")):
                if arm == "alone":
                    alone.append(read_arm(fd, reads, seed=r))
                    continue
                child = _decoder(model_dir)
                try:
                    time.sleep(CHILD_START_S)
                    if child.poll() is not None:
                        return None
                    cpu0, t0 = _task_cpu_ms(child.pid), time.perf_counter()
                    beside.append(read_arm(fd, reads, seed=r))
                    cpu1, t1 = _task_cpu_ms(child.pid), time.perf_counter()
                    alive = child.poll() is None
                finally:
                    child.kill()
                    child.wait()
                if not alive:
                    return None
                wall_ms = (t1 - t0) * 1e3
                shares.append(sorted(((cpu1[t] - cpu0.get(t, 0.0)) / wall_ms for t in cpu1),
                                     reverse=True)[:cores])
    finally:
        os.close(fd)
        scratch.unlink(missing_ok=True)
    per_wake = [w / s for w, s in beside if s > 0]
    per_wake_alone = [w / s for w, s in alone if s > 0]
    if not per_wake or not per_wake_alone:
        return None
    thread_shares = [statistics.median(s[i] for s in shares) for i in range(len(shares[0]))]
    beside_ms, alone_ms = statistics.median(per_wake), statistics.median(per_wake_alone)
    wait = conditional_wait(beside_ms, alone_ms, thread_shares, cores)
    if wait is None:
        return None
    return CoreWait(wait, beside_ms, alone_ms, statistics.median(s for _, s in beside),
                    math.prod(thread_shares), thread_shares, reads * rounds, rounds)


if __name__ == "__main__":
    model = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("models/tiny-trained-stream")
    if not (model / "manifest.json").is_file():
        sys.exit(f"core_wait_probe: {model}: no converted model (manifest.json missing)")
    found = measure_core_wait(model, model.resolve().parent)
    print(found if found is not None else "core_wait_probe: nothing measured (not Linux, more "
          "cores than the decode's threads, or the decoding child stopped)")
