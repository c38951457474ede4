"""Storage probes: real reads of a scratch file next to the model, with plain syscalls through
the engine's platform seam (engine.platform). Cold reads: on Linux the engine's buffered
descriptor with the file's pages dropped (fdatasync + POSIX_FADV_DONTNEED) before every cold
batch; on macOS, which cannot drop one file's pages, the scratch file is written and read
through uncached descriptors (F_NOCACHE), so its reads come from the device. Device latency,
bandwidth and queue depth use the uncached descriptor on both (O_DIRECT, F_NOCACHE). What each
measures, and how calibration.profile_values fits it, is in that module's docstring. Every
timing is `expected`, the mean of its repeats."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np

from calibration.machine import GIB, last_level_cache_bytes, ram_gib
from calibration.profile_values import DEFAULT_SIZES, DROP_PAGES, MIB, StorageResult, expected
from calibration.reclaim_probe import reclaim_times
from calibration.scratch_reads import pread_all, random_offsets
from contract.thresholds import ALIGN
from engine import platform


def _drop(fd: int) -> None:
    platform.current().flush(fd)
    platform.current().drop_pages(fd)


def write_scratch(path: Path, nbytes: int, seed: int = 0) -> None:
    """Incompressible bytes, synced to the device (dirty pages cannot be dropped). Where the
    platform cannot drop a file's pages, written through an uncached descriptor from an
    aligned buffer, so that none of it stays in the page cache."""
    rng = np.random.default_rng(seed)
    chunk = 8 * MIB
    p = platform.current()
    if p.can_drop_pages:
        with open(path, "wb") as f:
            for _ in range(nbytes // chunk):
                f.write(rng.integers(0, 256, chunk, dtype=np.uint8).tobytes())
            f.flush()
            os.fsync(f.fileno())
        return
    buf = mmap.mmap(-1, chunk)  # page-aligned: uncached writes may require it
    fd = p.create_uncached(str(path))
    try:
        for _ in range(nbytes // chunk):
            buf[:] = rng.integers(0, 256, chunk, dtype=np.uint8).tobytes()
            with memoryview(buf) as view:
                write_all(fd, view)
        p.flush(fd)
    finally:
        os.close(fd)
        buf.close()


def write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


MIN_CACHE_FLUSH_BYTES = 64 << 20  # where the machine reports no cache size


def cache_flush_bytes(llc_bytes: int | None, ram_bytes: int) -> int:
    """Bytes to write so that what was read before is no longer in the CPU's caches: twice
    the last-level cache (calibration.machine.last_level_cache_bytes; server CPUs have hundreds
    of MiB), at least MIN_CACHE_FLUSH_BYTES and at most an eighth of the RAM."""
    ceiling = max(ram_bytes // 8, MIN_CACHE_FLUSH_BYTES)
    return int(min(max(2 * (llc_bytes or 0), MIN_CACHE_FLUSH_BYTES), ceiling))


def warm_flush_bytes() -> int:
    """cache_flush_bytes for this machine (calibration.machine's cache size and RAM)."""
    return cache_flush_bytes(last_level_cache_bytes(), int(ram_gib()[0] * GIB))


def flush_cpu_caches(scratch: np.ndarray) -> None:
    """Write a buffer larger than the CPU's caches, so the page-cache pages just read are no
    longer in them: a decoding engine's warm reads come from a page cache far larger than the
    CPU's caches (a copy from memory), not from bytes it has just touched."""
    scratch.fill(scratch[0] ^ 1)


def buffered_reads(path: Path, sizes: tuple[int, ...], per_size: int, rounds: int,
                   seed: int = 0, flush_bytes: int | None = None
                   ) -> tuple[list[float], list[float]]:
    """Mean cold and warm pread time (ms) per size, on the engine's buffered descriptor
    (engine.platform open_buffered). Cold: its pages dropped first, or, where the platform
    cannot drop them, through an uncached descriptor; warm: the same offsets again, buffered
    (first read once untimed where the cold reads did not fill the page cache), after the
    CPU's caches were flushed (`flush_cpu_caches`, writing `flush_bytes`: by default
    `warm_flush_bytes()`)."""
    p = platform.current()
    rng = np.random.default_rng(seed)
    fd = p.open_buffered(str(path))
    cold_fd = fd if p.can_drop_pages else p.open_uncached(str(path))
    try:
        file_bytes = os.fstat(fd).st_size
        cold: dict[int, list[float]] = {s: [] for s in sizes}
        warm: dict[int, list[float]] = {s: [] for s in sizes}
        buf = mmap.mmap(-1, -(-max(sizes) // ALIGN) * ALIGN)  # aligned, for uncached reads
        flush = np.zeros(warm_flush_bytes() if flush_bytes is None else flush_bytes,
                         dtype=np.uint8)
        for _ in range(rounds):
            for size in sizes:
                view = memoryview(buf)[:size]
                offsets = random_offsets(rng, file_bytes, size, per_size)
                if p.can_drop_pages:
                    _drop(fd)
                for off in offsets:
                    t0 = time.perf_counter()
                    pread_all(cold_fd, view, off)
                    cold[size].append((time.perf_counter() - t0) * 1e3)
                if cold_fd != fd:
                    for off in offsets:
                        pread_all(fd, view, off)
                flush_cpu_caches(flush)
                for off in offsets:
                    t0 = time.perf_counter()
                    pread_all(fd, view, off)
                    warm[size].append((time.perf_counter() - t0) * 1e3)
                view.release()
        if p.can_drop_pages:
            _drop(fd)
        buf.close()
        return ([expected(cold[s]) for s in sizes],
                [expected(warm[s]) for s in sizes])
    finally:
        os.close(fd)
        if cold_fd != fd:
            os.close(cold_fd)


def page_drop_times(path: Path, n: int = 24, seed: int = 3) -> tuple[float, float] | None:
    """Median us to drop a cached range of each DROP_PAGES size from the page cache
    (POSIX_FADV_DONTNEED, as the engine's page-cache budget drops an evicted bundle), each
    range read first so its pages are cached; None where pages cannot be dropped (macOS). The
    file is dropped whole first: pages a write left cached can sit in large folios, which a
    drop of part of one leaves alone, where a read through the engine's descriptor
    (FADV_RANDOM) caches pages one by one, as the engine's own cold reads do."""
    p = platform.current()
    if not p.can_drop_pages:
        return None
    rng = np.random.default_rng(seed)
    fd = p.open_buffered(str(path))
    try:
        _drop(fd)
        file_bytes = os.fstat(fd).st_size
        buf = mmap.mmap(-1, max(DROP_PAGES) * ALIGN)
        out = []
        for pages in DROP_PAGES:
            size = pages * ALIGN
            view = memoryview(buf)[:size]
            times = []
            for off in random_offsets(rng, file_bytes, size, n):
                pread_all(fd, view, off)
                t0 = time.perf_counter_ns()
                p.drop_pages(fd, off, size)
                times.append((time.perf_counter_ns() - t0) / 1e3)
            view.release()
            out.append(float(np.median(times)))
        buf.close()
        return out[0], out[1]
    finally:
        os.close(fd)


def _direct_fd(path: Path) -> int | None:
    """An uncached descriptor (O_DIRECT, F_NOCACHE); None where the filesystem refuses it."""
    try:
        return platform.current().open_uncached(str(path))
    except (OSError, AttributeError):
        return None


def direct_latency_ms(path: Path, n: int = 64, seed: int = 1) -> float | None:
    """Mean O_DIRECT 4 KiB random read, QD1 (None when O_DIRECT is refused)."""
    fd = _direct_fd(path)
    if fd is None:
        return None
    try:
        buf = mmap.mmap(-1, ALIGN)
        view = memoryview(buf)
        rng = np.random.default_rng(seed)
        times = []
        for off in random_offsets(rng, os.fstat(fd).st_size, ALIGN, n):
            t0 = time.perf_counter()
            pread_all(fd, view, off)
            times.append((time.perf_counter() - t0) * 1e3)
        view.release()
        return expected(times)
    except OSError:
        return None
    finally:
        os.close(fd)


def direct_sequential_gbps(path: Path, chunk: int = 4 * MIB) -> float | None:
    fd = _direct_fd(path)
    if fd is None:
        return None
    try:
        buf = mmap.mmap(-1, chunk)
        view = memoryview(buf)
        size = os.fstat(fd).st_size // chunk * chunk
        t0 = time.perf_counter()
        for off in range(0, size, chunk):
            pread_all(fd, view, off)
        seconds = time.perf_counter() - t0
        view.release()
        return size / seconds / 1e9
    except OSError:
        return None
    finally:
        os.close(fd)


def queue_throughput(path: Path, threads: tuple[int, ...] = (1, 2, 4, 8), size: int = MIB,
                     per_thread: int = 12, seed: int = 2) -> dict[int, float]:
    """Aggregate GB/s of n threads each doing O_DIRECT random reads of `size` (preadv releases
    the GIL, so the threads really queue at the device)."""
    out: dict[int, float] = {}
    if _direct_fd_ok(path) is False:
        return out
    rng = np.random.default_rng(seed)
    file_bytes = path.stat().st_size
    for n in threads:
        offsets = random_offsets(rng, file_bytes, size, n * per_thread)
        if len(offsets) < n * per_thread:
            per = len(offsets) // n
        else:
            per = per_thread
        parts = [offsets[i * per:(i + 1) * per] for i in range(n)]
        barrier = threading.Barrier(n + 1)
        errors: list[BaseException] = []
        workers = [threading.Thread(target=_direct_worker, args=(path, size, p, barrier, errors))
                   for p in parts]
        for w in workers:
            w.start()
        barrier.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
        if not errors and seconds > 0:
            out[n] = n * per * size / seconds / 1e9
    return out


def _direct_worker(path: Path, size: int, offsets: list[int], barrier: threading.Barrier,
                   errors: list[BaseException]) -> None:
    fd = platform.current().open_uncached(str(path))
    buf = mmap.mmap(-1, size)
    view = memoryview(buf)
    try:
        barrier.wait()
        for off in offsets:
            pread_all(fd, view, off)
    except BaseException as err:  # noqa: BLE001 - reported by the caller
        errors.append(err)
    finally:
        view.release()
        os.close(fd)


def _direct_fd_ok(path: Path) -> bool:
    fd = _direct_fd(path)
    if fd is None:
        return False
    os.close(fd)
    return True


def measure_storage(directory: Path, scratch_bytes: int = 128 * MIB,
                    sizes: tuple[int, ...] = DEFAULT_SIZES, per_size: int = 8, rounds: int = 3,
                    threads: tuple[int, ...] = (1, 2, 4, 8)) -> StorageResult:
    """All storage measurements on a scratch file in `directory` (removed afterwards)."""
    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".ssdmoe-calibrate-{os.getpid()}.bin"
    try:
        write_scratch(path, scratch_bytes)
        flush = warm_flush_bytes()
        cold, warm = buffered_reads(path, sizes, per_size, rounds, flush_bytes=flush)
        lat = direct_latency_ms(path)
        seq = direct_sequential_gbps(path)
        queue = queue_throughput(path, threads)
        drops = page_drop_times(path)
        reclaim = reclaim_times(path)
    finally:
        path.unlink(missing_ok=True)
    notes = []
    uncached = platform.current().uncached
    if not platform.current().can_drop_pages:
        notes.append(f"{platform.current().name}: no page drops, so the scratch file was "
                     f"written and its cold reads made through {uncached} descriptors (device "
                     "reads without the page cache's fill)")
    if isinstance(reclaim, str):
        notes.append(f"no direct-reclaim figure (reclaim_us_per_page): {reclaim}")
        reclaim = None
    else:
        reclaim = (reclaim.pages[-1], reclaim.extra_cpu_ms[-1],
                   reclaim.reclaimed_pages / max(reclaim.read_pages, 1), reclaim.extra_ms[-1])
    if lat is None or seq is None:
        notes.append(f"{uncached} refused by this filesystem: latency and bandwidth from "
                     "buffered cold reads only")
    return StorageResult(list(sizes), cold, warm, lat if lat is not None else -1.0,
                         seq if seq is not None else -1.0, queue, str(directory), scratch_bytes,
                         time.perf_counter() - t0, notes, drops, flush, reclaim)
