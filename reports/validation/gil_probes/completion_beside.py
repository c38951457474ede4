"""Where a cold read's CPU goes when every core is busy: the reading thread's own CPU, and the
completion work (the disk interrupt and the block layer's softirq, on whichever core takes it:
on this VM every disk interrupt lands on one vCPU, /proc/interrupts) that no thread of the
reader's is charged with.

A spinning process pinned to each core counts its progress in shared memory; a thread of this
process alternates short slices of cold reads of a scratch file (9 preads of 8 KiB at random
pages, those pages dropped first; 1 ms asleep before each read) and slices of the same sleeps
without reads. In a slice the spinners' lost core time, less the reading thread's own CPU, is
the work that ran for nobody's thread; the cold slices' excess of it over the idle ones'
(paired neighbours, median) is the completion work. Then the same cold slices without the
spinners give the reader's own CPU alone, which is what calibrate's cold_read_cpu_ms measures.

Used for the README's "tried and not adopted" (2026-12-04): modelling the completion work as
CPU on a busy core, on top of the isolated cold_read_cpu_ms the sim already charges, counts
part of it twice: beside busy cores the reader's own CPU fell by 0.08-0.17 ms a read while the
completion work was 0.05-0.26 ms (six runs, 16:16-16:20 and 18:11-18:12 UTC: noisy).

    uv run python reports/validation/gil_probes/completion_beside.py [PAIRS]   # 40: ~25 s
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from calibration.core_wait_probe import (  # noqa: E402
    PREAD_BYTES,
    PREADS,
    SCRATCH_BYTES,
    open_scratch,
)

SLICE_S = 0.25  # one slice of reads or of sleeps
PAIRS = 40  # cold / idle slice pairs, order alternated
SETTLE_S = 0.5  # the spinners start before the first slice


def _spin(cpu: int, counter: mp.sharedctypes.Synchronized, stop: mp.synchronize.Event) -> None:
    os.sched_setaffinity(0, {cpu})
    n = 0
    while not stop.is_set():
        for _ in range(2000):
            n += 1
        counter.value = n


def lost_core_s(work: float, wall_s: float, cores: int, full_rate: float) -> float:
    """Core seconds the spinners did not get in a slice: `work` counted at `full_rate` per
    core second, of `cores` x `wall_s`."""
    return cores * wall_s - work / full_rate


def _slice(fd: int, cold: bool, rng: random.Random, counters: list, pages: int
           ) -> tuple[float, float, float, int]:
    """(spinners' work, wall s, this thread's CPU s, cold reads) of one slice."""
    w0 = sum(c.value for c in counters)
    c0, t0 = time.thread_time(), time.perf_counter()
    reads, end = 0, t0 + SLICE_S
    while time.perf_counter() < end:
        offsets = [rng.randrange(pages) * PREAD_BYTES for _ in range(PREADS)]
        if cold:
            for off in offsets:
                os.posix_fadvise(fd, off, PREAD_BYTES, os.POSIX_FADV_DONTNEED)
        time.sleep(0.001)
        if cold:
            for off in offsets:
                os.pread(fd, PREAD_BYTES, off)
            reads += 1
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return sum(c.value for c in counters) - w0, wall, cpu, reads


def measure(scratch_dir: Path, pairs: int) -> dict[str, float] | None:
    """Per cold read (ms): the reader's CPU alone and beside the spinners, the completion
    work on the spinners' cores; None off Linux."""
    if not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    scratch = Path(scratch_dir) / "completion_beside.scratch"
    fd = open_scratch(scratch)
    # the written pages out once (the kernel's per-CPU LRU batches drained): the range drops
    # before each read then find the pages read long before on the LRU
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    stop = mp.Event()
    counters = [mp.Value("q", 0, lock=False) for _ in cpus]
    spinners = [mp.Process(target=_spin, args=(cpu, counter, stop), daemon=True)
                for cpu, counter in zip(cpus, counters, strict=True)]
    rng, pages = random.Random(0), SCRATCH_BYTES // PREAD_BYTES
    slices: list[tuple[tuple[float, float, float, int], ...]] = []
    try:
        for p in spinners:
            p.start()
        time.sleep(SETTLE_S)
        for i in range(pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {cold: _slice(fd, cold, rng, counters, pages) for cold in order}
            slices.append((got[True], got[False]))
        stop.set()
        for p in spinners:
            p.join(timeout=5)
        alone = [_slice(fd, True, rng, [], pages) for _ in range(pairs // 2)]
    finally:
        stop.set()
        os.close(fd)
        scratch.unlink(missing_ok=True)
    cores = len(cpus)
    # a spinner's full rate: its work in the idle slices over the core time the thread left it
    full = statistics.median(w / (cores * wall - cpu) for _, (w, wall, cpu, _) in slices)
    completion, beside = [], []
    for (wc, tc, cc, n), (wi, ti, ci, _) in slices:
        if n:
            hidden_cold = lost_core_s(wc, tc, cores, full) - cc
            hidden_idle = lost_core_s(wi, ti, cores, full) - ci
            completion.append((hidden_cold - hidden_idle * tc / ti) / n * 1e3)
            beside.append(cc / n * 1e3)
    return {"reader_alone_ms": statistics.median(c / n * 1e3 for _, _, c, n in alone if n),
            "reader_beside_ms": statistics.median(beside),
            "completion_ms": statistics.median(completion),
            "completion_q1_ms": statistics.quantiles(completion, n=4)[0],
            "completion_q3_ms": statistics.quantiles(completion, n=4)[2],
            "reads": sum(n for (_, _, _, n), _ in slices)}


if __name__ == "__main__":
    where = ROOT / "models"  # the scratch file goes beside the models, on the same disk
    if not where.is_dir():
        sys.exit(f"completion_beside: {where}: no such directory (make the models first)")
    if len(sys.argv) > 1 and not (sys.argv[1].isdigit() and int(sys.argv[1]) >= 4):
        sys.exit(f"completion_beside: PAIRS must be a whole number >= 4, not {sys.argv[1]!r}")
    found = measure(where, int(sys.argv[1]) if len(sys.argv) > 1 else PAIRS)
    if found is None:
        sys.exit("completion_beside: Linux only (page drops, affinity)")
    f = found
    print(f"per cold read of {PREADS} preads ({f['reads']:.0f} reads beside the spinners):")
    print(f"  reader's own CPU alone          {f['reader_alone_ms']:.3f} ms")
    print(f"  reader's own CPU beside spinners {f['reader_beside_ms']:.3f} ms")
    print(f"  completion work on their cores  {f['completion_ms']:.3f} ms "
          f"(pair quartiles {f['completion_q1_ms']:.3f}-{f['completion_q3_ms']:.3f}; "
          f"{f['completion_ms'] / PREADS:.4f} a request)")
    print(f"  beside: reader + completion     {f['reader_beside_ms'] + f['completion_ms']:.3f} ms")
