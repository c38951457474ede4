"""Expert reads on native threads: a small C pool (engine/native/readpool.c) that reads each
bundle with one `preadv` into the caller's buffers, with no Python on the read path.

Why: a Python reader thread needs the interpreter lock to take a read off its queue and again
to return from `preadv`. While the main thread runs Python (a step's record, the next step's
graph) a woken reader waits for it: 1 ms behind 1 ms of Python
(reports/io/first-layer-hint/gil_probe.py), which is most of a cold prefetch's time on a
small model. The pool's threads never enter the interpreter, and the main thread waits for
their reads in C with the lock released (ctypes.CDLL releases it around every call).

The library is compiled on first use with the system's C compiler (`CC`, else `cc`) into the
user's cache (`XDG_CACHE_HOME`, else ~/.cache: ssdmoe/native/), named by the source's hash, so
an edited source is rebuilt. Where it cannot be built or loaded, `load` says why in one line and
the engine keeps its Python reader threads (engine.readers)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("native") / "readpool.c"
MAX_IOV = 1024  # readpool.c's MAX_IOV: a job of more iovecs is refused (EINVAL)
DONE = 2  # job state: 0 queued, 1 running, 2 done


class Job(ctypes.Structure):
    """One read: readpool.c's job_t, field for field."""

    _fields_ = [("fd", ctypes.c_int32), ("iovcnt", ctypes.c_int32),
                ("offset", ctypes.c_int64), ("length", ctypes.c_int64),
                ("iov", ctypes.c_void_p), ("map", ctypes.c_void_p),
                ("state", ctypes.c_int64), ("result", ctypes.c_int64), ("cold", ctypes.c_int64),
                ("started_ns", ctypes.c_int64), ("finished_ns", ctypes.c_int64),
                ("drops", ctypes.c_void_p), ("ndrops", ctypes.c_int64),
                ("next", ctypes.c_void_p)]


_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str] | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ssdmoe" / "native"


def _build(target: Path) -> str:
    """Compile the pool into `target`; '' when built, else why not (one line)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc.split()[0]) is None:
        return f"no C compiler ({cc!r} not on PATH) to build {SOURCE.name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    cmd = [*cc.split(), "-O2", "-shared", "-fPIC", "-pthread", str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        Path(tmp).unlink(missing_ok=True)
        return f"building {SOURCE.name} failed: {err}"
    if done.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        return f"building {SOURCE.name} with {cc} failed: {first}"
    os.replace(tmp, target)  # atomic: a concurrent build never loads half a file
    return ""


def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled pool (built on first use) and '' , or None and why it is not available."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if sys.platform not in ("linux", "darwin"):
            _loaded = None, f"native reads: not built on {sys.platform} (Linux and macOS only)"
            return _loaded
        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
        target = _cache_dir() / f"readpool-{digest}-{sys.platform}-{platform.machine()}.so"
        why = "" if target.is_file() else _build(target)
        if why:
            _loaded = None, why
            return _loaded
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as err:
            _loaded = None, f"loading {target} failed: {err}"
            return _loaded
        lib.rp_create.restype = ctypes.c_void_p
        lib.rp_create.argtypes = [ctypes.c_int]
        lib.rp_submit.restype = None
        lib.rp_submit.argtypes = [ctypes.c_void_p, ctypes.POINTER(Job)]
        lib.rp_help.restype = ctypes.c_int
        lib.rp_help.argtypes = [ctypes.c_void_p, ctypes.POINTER(Job)]
        lib.rp_wait.restype = None
        lib.rp_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.rp_cpu_ns.restype = ctypes.c_int64
        lib.rp_cpu_ns.argtypes = [ctypes.c_void_p]
        lib.rp_destroy.restype = None
        lib.rp_destroy.argtypes = [ctypes.c_void_p]
        _loaded = lib, ""
        return _loaded


class NativePool:
    """`n` native reader threads (started here). Jobs and the iovec arrays they point at must
    stay referenced until `wait` has returned for them: `submit` returns the job, which holds
    its iovec array (`job.keep`)."""

    def __init__(self, n: int, lib: ctypes.CDLL):
        self.lib = lib
        self.n = n
        self._pool = lib.rp_create(n)
        if not self._pool:
            raise OSError(f"native reads: could not start {n} threads")

    def submit(self, fd: int, offset: int, length: int, iovecs: ctypes.Array,
               map_addr: int = 0, drops: list[tuple[int, int, int]] = ()) -> Job:
        """Queue a read of `length` bytes at `offset` of `fd` into `iovecs` (a C iovec array,
        engine.range_reads.iovec_array), counting the range's resident pages first over the
        file's mapping at `map_addr` (0: unknown); then drop the pages of `drops` (fd, offset,
        length): the page-cache budget's victims of this read."""
        if not 1 <= len(iovecs) <= MAX_IOV:
            raise ValueError(f"native reads: {len(iovecs)} iovecs (1 to {MAX_IOV})")
        job = Job(fd=fd, iovcnt=len(iovecs), offset=offset, length=length,
                  iov=ctypes.addressof(iovecs), map=map_addr or None)
        job.keep = iovecs  # type: ignore[attr-defined]  # alive while the job may run
        if drops:
            flat = (ctypes.c_int64 * (3 * len(drops)))(*[v for d in drops for v in d])
            job.drops, job.ndrops = ctypes.addressof(flat), len(drops)
            job.keep_drops = flat  # type: ignore[attr-defined]
        self.lib.rp_submit(self._pool, ctypes.byref(job))
        return job

    def help(self, job: Job) -> bool:
        """Run `job` on this thread if no pool thread has started it (taken off the queue);
        False when one has. The interpreter lock is released while it reads."""
        return bool(self.lib.rp_help(self._pool, ctypes.byref(job)))

    def wait(self, jobs: list[Job]) -> None:
        """Return once every job of `jobs` is done (the interpreter lock released meanwhile)."""
        if jobs:
            ptrs = (ctypes.c_void_p * len(jobs))(*[ctypes.addressof(j) for j in jobs])
            self.lib.rp_wait(self._pool, ptrs, len(jobs))

    def cpu_ns(self) -> int:
        """The CPU time the pool's threads have used so far, ns; -1 where it cannot be read
        (macOS)."""
        return int(self.lib.rp_cpu_ns(self._pool)) if self._pool else 0

    def close(self) -> None:
        """Run what is queued, then stop and join the threads."""
        if self._pool:
            self.lib.rp_destroy(self._pool)
            self._pool = None
