"""The block-I/O read throttle (engine.throttle): a measured cold-read rate under it is within
10% of the rate set, for reads well above the rate; it is removed on exit and on error; and it
refuses, in one line, what it cannot do. The rate tests need root and a throttle controller
(this project's machines and CI have both); elsewhere they skip, saying why."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from contract.errors import BadInput
from engine.machine_limits import EmulatedMachine, MachineLimits
from engine.throttle import (
    ThrottleSpec,
    ThrottleUnavailable,
    block_device,
    check_available,
)

MB = 10**6


def _can_throttle() -> str | None:
    import tempfile

    try:
        check_available(ThrottleSpec(read_mbps=1))
        block_device(Path(tempfile.gettempdir()))  # scratch files live there: a real disk?
    except ThrottleUnavailable as err:
        return str(err)
    return None


needs_throttle = pytest.mark.skipif(_can_throttle() is not None,
                                    reason=f"no throttle here: {_can_throttle()}")


def _scratch(tmp_path: Path, nbytes: int) -> Path:
    f = tmp_path / "scratch.bin"
    with open(f, "wb") as fh:
        fh.write(os.urandom(nbytes))
        fh.flush()
        os.fsync(fh.fileno())
    return f


def _cold_read_rate(path: Path, direct: bool = True) -> float:
    """Bytes/s reading the whole file cold: O_DIRECT in 1 MiB reads (never served by the page
    cache), or buffered in 256 KiB reads right after dropping its pages (the engine's reads)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        if direct:
            buf = mmap.mmap(-1, 1 << 20)  # page aligned, as O_DIRECT needs
        else:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            buf = bytearray(256 << 10)
        t0, off = time.perf_counter(), 0
        while (n := os.preadv(fd, [buf], off)) > 0:
            off += n
        return off / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def _throttled(path: Path, spec: ThrottleSpec) -> EmulatedMachine:
    """The throttle alone, as capture and bench set it (engine.machine_limits)."""
    return EmulatedMachine(path, MachineLimits(throttle=spec))


def _groups() -> set[str]:
    root = Path("/sys/fs/cgroup/blkio")
    return {p.name for p in root.rglob("ssdmoe-*")} if root.exists() else set()


@needs_throttle
@pytest.mark.parametrize("mbps", [20, 40])
def test_cold_read_rate_within_10pct_of_throttle(tmp_path, mbps):
    size = int(mbps * MB * 2.0)  # 2 s of reading: the kernel's 0.1 s burst is <= 5% of it
    f = _scratch(tmp_path, size)
    try:
        free = _cold_read_rate(f)
        assert free > 2 * mbps * MB, f"disk itself too slow for the test ({free / MB:.0f} MB/s)"
        with _throttled(f, ThrottleSpec(read_mbps=mbps)) as th:
            got = _cold_read_rate(f)
            rec = th.throttle_record()
        assert abs(got / (mbps * MB) - 1) < 0.10, f"{got / MB:.1f} MB/s under {mbps} MB/s"
        assert rec["read_bps"] == mbps * MB and rec["device"] == block_device(f)
        after = _cold_read_rate(f)  # removed on exit: full speed again
        assert after > 2 * mbps * MB
    finally:
        f.unlink()


@needs_throttle
def test_buffered_engine_style_reads_are_throttled(tmp_path):
    mbps = 25
    f = _scratch(tmp_path, int(mbps * MB * 2))
    try:
        with _throttled(f, ThrottleSpec(read_mbps=mbps)):
            got = _cold_read_rate(f, direct=False)
        assert abs(got / (mbps * MB) - 1) < 0.10, f"{got / MB:.1f} MB/s under {mbps} MB/s"
    finally:
        f.unlink()


@needs_throttle
def test_iops_throttle(tmp_path):
    iops = 200
    f = _scratch(tmp_path, 4096 * 400)  # 400 O_DIRECT reads of 4 KiB at 200/s: ~2 s
    try:
        buf = mmap.mmap(-1, 4096)
        with _throttled(f, ThrottleSpec(read_iops=iops)):
            fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
            t0 = time.perf_counter()
            for i in range(400):
                os.preadv(fd, [buf], i * 4096)
            rate = 400 / (time.perf_counter() - t0)
            os.close(fd)
        assert abs(rate / iops - 1) < 0.10, f"{rate:.0f} reads/s under {iops}"
    finally:
        f.unlink()


@needs_throttle
def test_removed_on_error_and_interrupt(tmp_path):
    before = _groups()
    f = _scratch(tmp_path, 4096)
    try:
        for exc in (RuntimeError("boom"), KeyboardInterrupt()):
            with pytest.raises(type(exc)):
                with _throttled(f, ThrottleSpec(read_mbps=5)):
                    assert _groups() - before, "throttle group not created"
                    raise exc
            assert _groups() == before, "throttle group left behind"
            cg = Path("/proc/self/cgroup").read_text()
            assert "ssdmoe-" not in cg
    finally:
        f.unlink()


def test_bad_rates_are_one_line_errors():
    for kw in ({"read_mbps": 0}, {"read_mbps": -5}, {"read_iops": 0}):
        with pytest.raises(BadInput, match="must be > 0"):
            ThrottleSpec(**kw)


def test_unavailable_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ThrottleUnavailable, match="needs root"):
        check_available(ThrottleSpec(read_mbps=10))


def test_unavailable_on_macos(monkeypatch):
    import engine.cgroups as cg

    monkeypatch.setattr(cg.sys, "platform", "darwin")
    with pytest.raises(ThrottleUnavailable, match="darwin"):
        check_available(ThrottleSpec(read_mbps=10))


def test_unthrottled_is_a_no_op(tmp_path):
    with _throttled(tmp_path, ThrottleSpec()) as th:
        assert th.throttle_record() is None


def test_parse_from_text():
    assert ThrottleSpec.parse("12.5", "300") == ThrottleSpec(12.5, 300)
    assert ThrottleSpec.parse(None, None) == ThrottleSpec()
    with pytest.raises(BadInput, match="--read-mbps 'abc': not a number"):
        ThrottleSpec.parse("abc", None)
    with pytest.raises(BadInput, match="--read-iops '1.5': not a number"):
        ThrottleSpec.parse(None, "1.5")


def test_cli_bad_throttle_is_one_line(ssdmoe, tiny_random_converted, tmp_path):
    for value, msg in (("abc", "not a number"), ("0", "must be > 0"), ("-3", "must be > 0")):
        r = ssdmoe("capture", str(tiny_random_converted), "--out", str(tmp_path / "t"),
                   "--read-mbps", value)
        assert r.returncode == 2 and msg in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "t").exists()
