"""The engine in macOS mode (engine.platform.MacOS), run here on Linux: the Linux-only `os`
attributes hidden (posix_fadvise, O_DIRECT, RWF_NOWAIT, fdatasync), and the macOS fcntl
commands done by stand-ins (engine.platform.linux_stand_in_fcntl) that are checked here to do
what macOS does. It loads, generates the same tokens, captures a trace that says what the
platform provided, and refuses what macOS cannot do in one line."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import time

import pytest

from contract.engine_config import EngineConfig
from engine import platform
from engine.generate import generate
from engine.loader import load_streaming

LINUX_ONLY = ("posix_fadvise", "O_DIRECT", "RWF_NOWAIT", "fdatasync", "POSIX_FADV_RANDOM",
              "POSIX_FADV_DONTNEED", "POSIX_FADV_WILLNEED")
PROMPT = "The platform seam: def read(fd, n):"


@pytest.fixture
def macos(monkeypatch):
    previous = platform.use(platform.MacOS(fcntl=platform.linux_stand_in_fcntl))
    for name in LINUX_ONLY:
        monkeypatch.delattr(os, name, raising=False)
    yield platform.current()
    platform.use(previous)


def _resident_pages(path, size: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * (size // mmap.PAGESIZE))()
        assert libc.mincore(addr, size, vec) == 0
        libc.munmap(addr, size)
        return sum(v & 1 for v in vec)
    finally:
        os.close(fd)


def _cold_file(tmp_path, size=1 << 20):
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(size))
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    platform._FADVISE(fd, 0, 0, platform._FADV["DONTNEED"])
    os.close(fd)
    return f, size


def test_stand_ins_do_what_macos_does(tmp_path, macos):
    f, size = _cold_file(tmp_path)
    assert _resident_pages(f, size) == 0
    # F_NOCACHE: reads neither fill nor use the page cache
    fd = macos.open_uncached(str(f))
    buf = mmap.mmap(-1, size)
    assert os.preadv(fd, [buf], 0) == size
    os.close(fd)
    assert _resident_pages(f, size) == 0
    # F_RDADVISE: the range is read ahead into the page cache
    fd = macos.open_buffered(str(f))  # F_RDAHEAD 0 accepted
    macos.prefetch(fd, 0, size)
    deadline = time.monotonic() + 2
    while _resident_pages(f, size) < size // mmap.PAGESIZE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _resident_pages(f, size) == size // mmap.PAGESIZE
    os.close(fd)
    with pytest.raises(platform.PlatformUnavailable, match="page-cache budget"):
        macos.drop_pages(fd)
    assert macos.rwf_nowait is None and not macos.can_drop_pages


@pytest.mark.parametrize("preset,o_direct", [("on-demand", False), ("staged", False),
                                             ("on-demand", True)])
def test_same_tokens_as_linux(tiny_random_converted, monkeypatch, preset, o_direct):
    def run() -> list[int]:
        config = EngineConfig.from_preset(preset, o_direct=o_direct)
        eng = load_streaming(tiny_random_converted, config=config)
        model, tok, store = eng.model, eng.tokenizer, eng.store
        model, tok, store = eng.model, eng.tokenizer, eng.store
        try:
            return generate(model, tok, PROMPT, 10, temp=1.0, seed=5, stop_at_eos=False,
                            runtime=eng.runtime).tokens, store
        finally:
            eng.close()

    linux, linux_store = run()
    previous = platform.use(platform.MacOS(fcntl=platform.linux_stand_in_fcntl))
    try:
        for name in LINUX_ONLY:
            monkeypatch.delattr(os, name, raising=False)
        mac, mac_store = run()
    finally:
        platform.use(previous)
    assert mac == linux
    assert mac_store.residency_method == "mincore" and linux_store.platform.name == "linux"
    assert mac_store.platform.name == "darwin" and mac_store.direct == o_direct


def test_capture_records_what_the_platform_provided(tiny_random_converted, tmp_path, ssdmoe,
                                                   macos):
    out = tmp_path / "t"
    r = ssdmoe("capture", str(tiny_random_converted), "--out", str(out), "--max-tokens", "4",
               "--preset", "staged", "--no-progress")
    assert r.returncode == 0, r.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["complete"]
    p = run["engine"]["platform"]
    assert p["name"] == "darwin" and p["page_cache_budget"] is False
    assert p["residency"] == "mincore" and p["uncached_reads"] == "F_NOCACHE"
    import polars as pl

    from traces.reader import read_trace

    loads = read_trace(out).loads
    assert loads.height > 0 and loads["cold"].dtype == pl.Boolean


def test_page_cache_budget_refused_in_one_line(tiny_random_converted, tmp_path, ssdmoe, macos):
    r = ssdmoe("capture", str(tiny_random_converted), "--out", str(tmp_path / "t"),
               "--page-cache-fraction", "0.25", "--no-progress")
    assert r.returncode == 2
    assert "page-cache budget" in r.stderr and "darwin" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_validate_skips_what_macos_cannot_run(tiny_random_converted, macos, monkeypatch):
    """Page-cache budgets cannot be held on macOS (and the kernel throttle is Linux's): the
    matrix keeps what can run and names the rest, each reason said once."""
    import engine.cgroups as cgroups
    from ssdmoe_cli.validate_cmd import _runnable
    from validation.matrix import default_matrix

    monkeypatch.setattr(cgroups.sys, "platform", "darwin")
    configs = default_matrix(quick=True).configs()
    kept, skipped, heads = _runnable(configs, tiny_random_converted, train_heads=False)
    assert kept and all(c.page_cache == "all" and not c.throttled for c in kept)
    assert heads is None and all(c.path != "staged-token" for c in kept)
    assert set(skipped) | {c.name for c in kept} == {c.name for c in configs}
