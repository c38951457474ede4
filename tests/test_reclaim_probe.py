"""calibration.reclaim_probe: a cold read's direct reclaim at a memory group's limit, checked
against the kernel's own count of the pages it took back from the group, and its profile figure."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from profile_helpers import MACHINE, compute, storage

from calibration.profile_values import MIB, hardware_values
from calibration.reclaim_probe import PAGES, ROOM, reclaim_times
from engine.cgroups import CgroupUnavailable
from engine.machine_limits import MachineLimits, check_available
from sim.profiles import load_hardware


def _why_not() -> str | None:
    try:
        check_available(MachineLimits(mem_limit=1 << 30))
    except CgroupUnavailable as err:
        return str(err)
    return None


def _scratch(path: Path, nbytes: int) -> Path:
    with open(path, "wb") as f:
        for _ in range(nbytes // MIB):
            f.write(os.urandom(MIB))
        f.flush()
        os.fsync(f.fileno())
    return path


@pytest.mark.skipif(_why_not() is not None, reason=f"no memory control group: {_why_not()}")
def test_the_reads_at_the_limit_reclaim_as_many_pages_as_they_bring_in(tmp_path):
    """Inside the group every timed cold read had to free room first: the kernel's memory.stat
    counts about one page taken back from the group per page the reads brought in (a group
    that was not at its limit would count none), and the process is back in its own group."""
    home = Path("/proc/self/cgroup").read_text()
    # three paired rounds: one round's CPU difference once came out at 0 in the full suite
    r = reclaim_times(_scratch(tmp_path / "scratch.bin", 96 * MIB), rounds=3)
    assert not isinstance(r, str), r
    assert r.pages == PAGES and all(n > 0 for n in r.reads)
    assert r.reclaimed_pages >= 0.9 * r.read_pages, (r.reclaimed_pages, r.read_pages)
    assert all(ms > 0 for ms in r.outside_ms)
    # reclaim is the reading thread's work: a 640-page read costs it more CPU at the limit
    assert r.extra_cpu_ms[-1] > 0, r.extra_cpu_ms
    # each size reads at most half the room, so the fill's active pages outlast the reads
    assert all(n * size * 4096 <= ROOM // 2 for n, size in zip(r.reads, PAGES, strict=True))
    assert Path("/proc/self/cgroup").read_text() == home


def test_a_scratch_file_too_small_is_one_line(tmp_path):
    if _why_not() is not None:
        pytest.skip("the size is checked after the memory controller")
    why = reclaim_times(_scratch(tmp_path / "small.bin", 8 * MIB))
    assert isinstance(why, str) and "too small" in why and "small.bin" in why


@pytest.mark.parametrize(("extra_cpu_ms", "want"), [(0.32, 0.5), (-0.01, 0.0)])
def test_the_profile_figure_is_the_extra_cpu_per_page(extra_cpu_ms, want, tmp_path):
    """640 pages read with 0.32 ms more of the thread's CPU at the limit: 0.5 us a page,
    whatever the wall time did (the device's jitter); a read with no more CPU (noise below
    zero) charges nothing. The figure round-trips through a written profile."""
    st = dataclasses.replace(storage(), reclaim=(640, extra_cpu_ms, 1.02, 0.9))
    values = hardware_values(st, compute(), MACHINE)
    assert values["reclaim_us_per_page"][0] == pytest.approx(want)
    assert "memory control group" in values["reclaim_us_per_page"][1]
    assert "reclaim_us_per_page" not in hardware_values(storage(), compute(), MACHINE)
    from calibration.profile_values import hardware_toml, write_hardware
    path = write_hardware(tmp_path / "h.toml", hardware_toml(values, "h", "now", "test"))
    assert load_hardware(str(path)).reclaim_us_per_page == pytest.approx(want)
