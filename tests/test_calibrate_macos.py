"""`ssdmoe calibrate` in the engine's macOS mode, run here on Linux as tests/test_platform_macos.py
runs the engine: the Linux-only `os` attributes hidden (posix_fadvise, O_DIRECT, ...) and the
macOS fcntl commands done by their stand-ins. With no page drops, cold reads come from a scratch
file and a model copy written uncached (F_NOCACHE), read uncached; the kernel's mincore checks
that the copy is not in the page cache, and macOS's `vm_stat` is read by hand."""

from __future__ import annotations

import filecmp
import json
import os

import pytest
from test_platform_macos import LINUX_ONLY, _resident_pages

from calibration.machine import darwin_held
from engine import platform
from engine.manifest import read_manifest


@pytest.fixture
def macos_spied(monkeypatch):
    """macOS mode, with every fcntl command the platform issues recorded."""
    seen: list[int] = []

    def fcntl(fd, cmd, arg):
        seen.append(cmd)
        return platform.linux_stand_in_fcntl(fd, cmd, arg)

    previous = platform.use(platform.MacOS(fcntl=fcntl))
    for name in LINUX_ONLY:
        monkeypatch.delattr(os, name, raising=False)
    yield seen
    platform.use(previous)


def test_the_uncached_copy_is_the_model_and_not_in_the_page_cache(tiny_random_converted,
                                                                   tmp_path, macos_spied):
    from calibration.uncached_copy import uncached_copy

    copy = uncached_copy(tiny_random_converted, tmp_path / "copy")
    assert platform.F_NOCACHE in macos_spied
    manifest = read_manifest(copy)
    files = sorted({manifest.layers[i].file for i in manifest.moe_layers})
    assert files
    for name in files:
        src, dst = tiny_random_converted / name, copy / name
        size = dst.stat().st_size
        # at most the last partial page (appended plainly) is cached
        assert _resident_pages(dst, size // platform.PAGE * platform.PAGE) == 0
        assert filecmp.cmp(src, dst, shallow=False)  # the same bytes (now read: cached)
    assert (copy / "manifest.json").read_bytes() == (
        tiny_random_converted / "manifest.json").read_bytes()


@pytest.mark.slow
def test_calibrate_runs_in_macos_mode(tiny_random_converted, tmp_path, model_copy, macos_spied):
    from calibration.calibrate import calibrate
    from engine.queue_depth import FILE

    model = model_copy(tiny_random_converted)
    cal = calibrate(model, tmp_path, quick=True)
    assert platform.F_NOCACHE in macos_spied  # cold reads uncached, not dropped pages
    assert not list(tmp_path.glob(".ssdmoe-*"))  # scratch file and model copy removed
    st, c = cal.storage, cal.compute
    assert any("F_NOCACHE" in note for note in st.notes)
    assert all(t > 0 for t in st.cold_ms + st.warm_ms)
    assert st.cold_ms[-1] > st.warm_ms[-1]  # an uncached 8 MiB read is slower than a warm one
    assert st.direct_4k_ms > 0 and st.direct_seq_gbps > 0 and st.queue_gbps
    # the engine's cold reads, from the never-cached copy
    assert c.cold_bundles > 0 and c.cold_bundle_ms > 0 and c.cold_read_reps > 0
    assert c.cold_page_cpu and all(ms == ms for _, ms in c.cold_page_cpu)  # measured
    assert c.refused_warm_ms == c.refused_warm_ms
    record = json.loads((model / FILE).read_text())
    assert "F_NOCACHE" in record["how"]
    for key in ("ssd_bandwidth_gbps", "ssd_latency_ms", "cold_overhead_ms", "memcpy_gbps",
                "cold_read_cpu_ms"):
        assert key in cal.hardware, key
    assert "page_drop_us_per_page" not in cal.hardware  # macOS drops no file's pages


VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                                3000.
Pages active:                            200000.
Pages inactive:                          190000.
Pages speculative:                         5000.
Pages throttled:                              0.
Pages wired down:                        100000.
Pages purgeable:                          10000.
"Translation faults":                 123456789.
Pages copy-on-write:                    1234567.
Anonymous pages:                         250000.
File-backed pages:                       145000.
Pages stored in compressor:              300000.
Pages occupied by compressor:             60000.
"""


def test_macos_memory_held_by_hand():
    # (wired 100000 + compressor 60000 + anonymous 250000 - purgeable 10000) x 16 KiB
    assert darwin_held(VM_STAT) == 400_000 * 16384
    with pytest.raises(ValueError, match="vm_stat"):
        darwin_held("Pages free: 3.")
