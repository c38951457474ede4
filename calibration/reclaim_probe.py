"""Direct reclaim: what a cold read costs once its memory is at its limit.

A memory control group at its limit (an emulated machine's `--mem-limit`), like a machine whose
RAM is full, frees as many pages as a cold read brings in, and it does so in the reading thread,
inside the read, before the new pages can be filled (a group's limit wakes no kswapd). That work
is not the same as dropping a known range (POSIX_FADV_DONTNEED, `page_drop_us_per_page`): the
kernel scans its LRU lists for victims, unmaps and frees them in batches. So it is measured where
it happens: cold reads of the scratch file by this process inside a fresh memory group that
earlier reads have filled to its limit, against the same reads, equally cold, outside any limit,
at two read sizes (a per-read and a per-page part). The kernel's own count of the pages it took
back from the group (memory.stat) says that the reads inside did reclaim.

What is compared is the reading thread's CPU time (the figure the simulator charges on a core,
sim.loads): reclaim is CPU work, and a cold read's wall time carries the device's jitter, which
is as large as the reclaim itself (reports/cross-machine/README.md). Before each size's reads the
group is filled again, and each size reads at most half the group's room, so the kernel always
has active pages to deactivate as well as inactive ones to free, as it does in decode, where
the popular experts are read again and again (with the fill used up, the reads would free only
the single-use pages of the reads before them).

Linux, root, a memory controller (cgroup v1 or v2); elsewhere `reclaim_times` says why not."""

from __future__ import annotations

import mmap
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calibration.profile_values import MIB
from calibration.scratch_reads import pread_all, random_offsets
from contract.thresholds import PAGE
from engine import platform
from engine.cgroups import CgroupUnavailable, ProcessGroups, hierarchy

PAGES = (15, 640)  # read sizes in 4 KiB pages: tiny-trained's and the wide model's bundles
# the group's limit: it is charged only for what the process reads and allocates once in it
# (engine.machine_limits), here the reads' pages and a buffer
ROOM = 32 * MIB
# memory.stat counters of pages the kernel took back from the group: v1 counts uncharges
# (pgpgout: a freed page cache page), v2 pages reclaimed (pgsteal)
RECLAIMED = {"v1": "pgpgout", "v2": "pgsteal"}


@dataclass
class ReclaimResult:
    pages: tuple[int, ...]  # read sizes, 4 KiB pages
    outside_ms: list[float]  # wall time of a cold read of each size, no limit (median)
    extra_ms: list[float]  # what the same read takes longer at the group's limit, wall time
    # (median of the rounds' differences of medians)
    extra_cpu_ms: list[float]  # the same for the reading thread's CPU time: the reclaim
    reads: list[int]  # reads timed per size, each side of each round (at most half the room)
    reclaimed_pages: int  # the kernel's count over the timed reads at the limit
    read_pages: int  # pages those reads brought in
    version: str  # "v1" or "v2"


def _stat(group: Path, name: str) -> int:
    for line in (group / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    raise CgroupUnavailable(f"{group / 'memory.stat'}: no {name} counter")


def _cold_reads(fd: int, offsets: list[int], size: int) -> tuple[float, float]:
    """Median wall and thread-CPU ms of the reads of `size` bytes at `offsets` (each range cold:
    never read since the file's pages were dropped)."""
    buf = mmap.mmap(-1, size)
    view = memoryview(buf)
    wall, cpu = [], []
    try:
        for off in offsets:
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            pread_all(fd, view, off)
            cpu.append((time.thread_time_ns() - c0) / 1e6)
            wall.append((time.perf_counter_ns() - t0) / 1e6)
    finally:
        view.release()
        buf.close()
    return statistics.median(wall), statistics.median(cpu)


def reclaim_times(path: Path, pages: tuple[int, ...] = PAGES, rounds: int = 3, seed: int = 5
                  ) -> ReclaimResult | str:
    """Cold reads of `path` (a synced scratch file of at least 96 MiB) outside and then inside
    a memory group at its limit, in `rounds` pairs (each pair's two sides close in time: this
    machine's speed drifts); the one-line reason where that cannot be done.

    The group is filled as an engine fills it: its limit's worth of pages read twice, so that
    they are active (a second access), as a model's popular experts are; a cold read then makes
    the kernel deactivate and free them, not only take single-use pages off the inactive list."""
    p = platform.current()
    if not p.can_drop_pages:
        return f"{p.name}: no memory control groups (cold reads cannot be made at a limit)"
    try:
        version, _ = hierarchy("memory")
    except CgroupUnavailable as err:
        return str(err)
    file_bytes = path.stat().st_size
    timed_bytes = file_bytes - ROOM
    if timed_bytes < 64 * MIB:
        return f"{path}: {file_bytes} bytes is too small a scratch file for the reclaim probe"
    rng = np.random.default_rng(seed)
    part = timed_bytes // len(pages)  # each size reads its own part of the file
    # at most half the group's room a size: the fill's active pages outlast the timed reads
    plan = [(n * PAGE, [i * part + off for off in random_offsets(
        rng, part, n * PAGE, max(1, min(60, ROOM // 2 // (n * PAGE))))])
            for i, n in enumerate(pages)]
    fill = list(range(timed_bytes, file_bytes - MIB + 1, MIB))
    name = "memory.limit_in_bytes" if version == "v1" else "memory.max"
    outside: list[list[tuple[float, float]]] = [[] for _ in plan]
    limited: list[list[tuple[float, float]]] = [[] for _ in plan]
    reclaimed = 0
    fd = p.open_buffered(str(path))
    try:
        p.flush(fd)
        for _ in range(rounds):
            p.drop_pages(fd)
            for i, (size, offs) in enumerate(plan):
                outside[i].append(_cold_reads(fd, offs, size))
            p.drop_pages(fd)
            with ProcessGroups({"memory": [(name, str(ROOM))]}, what="reclaim probe") as groups:
                group = groups.group_dir("memory")
                for i, (size, offs) in enumerate(plan):
                    for _ in range(2):  # the group at its limit, its pages active
                        _cold_reads(fd, fill, MIB)
                    before = _stat(group, RECLAIMED[version])
                    limited[i].append(_cold_reads(fd, offs, size))
                    reclaimed += _stat(group, RECLAIMED[version]) - before
        p.drop_pages(fd)
    except CgroupUnavailable as err:
        return str(err)
    finally:
        os.close(fd)

    def extra(part: int) -> list[float]:  # 0: wall, 1: CPU
        return [statistics.median(b[part] - a[part] for a, b in zip(o, w, strict=True))
                for o, w in zip(outside, limited, strict=True)]
    read_pages = rounds * sum(size // PAGE * len(offs) for size, offs in plan)
    return ReclaimResult(tuple(pages), [statistics.median(a[0] for a in o) for o in outside],
                         extra(0), extra(1),
                         [len(o) for _, o in plan], reclaimed, read_pages, version)
