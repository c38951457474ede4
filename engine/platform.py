"""The platform seam: every OS-specific I/O call the engine's store makes, in one place.

                      Linux                           macOS
  buffered open       O_RDONLY, POSIX_FADV_RANDOM     O_RDONLY, fcntl(F_RDAHEAD, 0)
                      (a read caches only its pages)  (read-ahead off)
  uncached open       O_DIRECT (aligned reads)        fcntl(F_NOCACHE, 1)
  uncached create     O_DIRECT (aligned writes)       fcntl(F_NOCACHE, 1)
  non-blocking probe  preadv(RWF_NOWAIT)              none: residency by mincore
  residency           mincore                         mincore (only bit 0 is defined:
                                                      masked; `ResidencyProbe`)
  drop pages          POSIX_FADV_DONTNEED             none: no per-file page-cache budget
  prefetch hint       POSIX_FADV_WILLNEED             fcntl(F_RDADVISE)
  flush before drop   fdatasync                       fsync
  RSS                 /proc/self/statm (current)      getrusage ru_maxrss (bytes; the peak)

What a platform lacks is said, not faked: `features()` goes into run.json (engine.platform), and
a page-cache budget on a platform that cannot drop pages is refused in one line
(`require_page_drop`). `use()` swaps the platform (the tests run the engine in macOS mode on
Linux, with `linux_stand_in_fcntl` implementing the macOS fcntl commands by the Linux calls that
do the same). No MLX here."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from contract.errors import BadInput

PAGE = mmap.PAGESIZE
# macOS <sys/fcntl.h>
F_RDAHEAD, F_RDADVISE, F_NOCACHE = 45, 44, 48

# The Linux facilities, kept at import (the macOS-mode tests hide them from `os`).
_O_DIRECT = getattr(os, "O_DIRECT", None)
_FADVISE = getattr(os, "posix_fadvise", None)
_FADV = {name: getattr(os, f"POSIX_FADV_{name}", None) for name in ("RANDOM", "DONTNEED",
                                                                      "WILLNEED")}


class PlatformUnavailable(BadInput):
    """A feature this platform does not provide (one line saying which and why)."""


class Linux:
    name = "linux"
    uncached = "O_DIRECT"
    can_drop_pages = True

    @property
    def rwf_nowait(self) -> int | None:
        return getattr(os, "RWF_NOWAIT", None)

    def open_buffered(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def open_uncached(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)

    def create_uncached(self, path: str) -> int:
        """A new file whose writes bypass the page cache (aligned buffers and lengths)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)

    def drop_pages(self, fd: int, offset: int = 0, length: int = 0) -> None:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def prefetch(self, fd: int, offset: int, length: int) -> None:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)

    def flush(self, fd: int) -> None:
        os.fdatasync(fd)

    _statm: tuple[int, int] | None = None  # (pid, fd): a forked child reopens it

    def rss_bytes(self) -> int:
        try:
            if self._statm is None or self._statm[0] != os.getpid():
                fd = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                Linux._statm = (os.getpid(), fd)
            return int(os.pread(Linux._statm[1], 256, 0).split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            return -1

    def features(self) -> dict[str, Any]:
        return {"name": self.name, "uncached_reads": self.uncached,
                "residency": "rwf_nowait+mincore" if self.rwf_nowait else "mincore",
                "page_cache_budget": True, "prefetch_hint": "POSIX_FADV_WILLNEED",
                "rss": "current (/proc/self/statm)"}


class MacOS:
    name = "darwin"
    uncached = "F_NOCACHE"
    can_drop_pages = False
    rwf_nowait = None

    def __init__(self, fcntl: Callable[[int, int, Any], Any] | None = None):
        if fcntl is None:
            import fcntl as _fcntl

            fcntl = _fcntl.fcntl
        self.fcntl = fcntl

    def open_buffered(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.fcntl(fd, F_RDAHEAD, 0)
        return fd

    def open_uncached(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.fcntl(fd, F_NOCACHE, 1)
        return fd

    def create_uncached(self, path: str) -> int:
        """A new file whose writes do not stay in the page cache (F_NOCACHE): with no way to
        drop a file's pages, this is how a scratch file starts cold."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                     0o644)
        self.fcntl(fd, F_NOCACHE, 1)
        return fd

    def drop_pages(self, fd: int, offset: int = 0, length: int = 0) -> None:
        raise PlatformUnavailable("macOS cannot drop one file's pages from its page cache (no "
                                  "posix_fadvise DONTNEED): a page-cache budget is unavailable")

    def prefetch(self, fd: int, offset: int, length: int) -> None:
        self.fcntl(fd, F_RDADVISE, struct.pack("qi", offset, length))  # struct radvisory

    def flush(self, fd: int) -> None:
        os.fsync(fd)

    def rss_bytes(self) -> int:
        # ru_maxrss is bytes on macOS (kilobytes on Linux, where the tests run this mode)
        unit = 1 if sys.platform == "darwin" else 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * unit

    def features(self) -> dict[str, Any]:
        return {"name": self.name, "uncached_reads": self.uncached, "residency": "mincore",
                "page_cache_budget": False, "prefetch_hint": "F_RDADVISE",
                "rss": "peak (getrusage ru_maxrss): macOS has no cheap current RSS"}


def linux_stand_in_fcntl(fd: int, cmd: int, arg: Any) -> int:
    """macOS's fcntl commands, done on Linux by the calls that have the same effect: F_NOCACHE
    sets O_DIRECT on the descriptor (reads neither fill nor use the page cache), F_RDAHEAD 0
    is POSIX_FADV_RANDOM, F_RDADVISE is POSIX_FADV_WILLNEED of the range. For tests only."""
    import fcntl

    if cmd == F_NOCACHE:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        return fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if arg else flags & ~_O_DIRECT)
    if cmd == F_RDAHEAD:
        _FADVISE(fd, 0, 0, _FADV["RANDOM"] if arg == 0 else 0)
        return 0
    if cmd == F_RDADVISE:
        offset, count = struct.unpack("qi", arg)
        _FADVISE(fd, offset, count, _FADV["WILLNEED"])
        return 0
    raise OSError(22, f"fcntl command {cmd} has no Linux stand-in")


def for_system(system: str = sys.platform) -> Linux | MacOS:
    return MacOS() if system == "darwin" else Linux()


_current: Linux | MacOS = for_system()


def current() -> Linux | MacOS:
    return _current


def use(p: Linux | MacOS) -> Linux | MacOS:
    """Make `p` the platform (returns the previous one)."""
    global _current
    previous, _current = _current, p
    return previous


def require_page_drop(what: str) -> None:
    """One line naming `what` when this platform cannot drop a file's pages."""
    if not _current.can_drop_pages:
        raise PlatformUnavailable(f"{what}: needs dropping a file's pages from the page cache, "
                                  f"which {_current.name} cannot do (no posix_fadvise DONTNEED)")


# ---------------------------------------------------------------- residency (mincore)
# Which pages of a file are in the page cache, by mincore on a never-touched PROT_READ
# mapping of it (an untouched mapping maps no pages, so it neither warms the cache nor pins
# pages against POSIX_FADV_DONTNEED).

# A mincore call from Python costs far more than each page it covers: ranges closer than this
# share one call.
MERGE_GAP_PAGES = 16

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
# libc called holding the GIL (PyDLL), for calls of a few microseconds: less than a hand-over
# of the GIL to another thread and back, which a reader otherwise pays around every call while
# the main thread builds graphs (engine.range_reads' warm copies use it too).
libc_holding_gil = ctypes.PyDLL(None, use_errno=True)
# mincore over a bundle takes about a microsecond; spans longer than HOLD_GIL_PAGES (a whole
# file) release the GIL.
_mincore_holding_gil = libc_holding_gil.mincore
_mincore_holding_gil.argtypes = _libc.mincore.argtypes
HOLD_GIL_PAGES = 1024
_MAP_FAILED = ctypes.c_void_p(-1).value
# mincore defines only bit 0 (resident); Linux writes exactly 0 or 1, others may set more bits.
_MINCORE_CLEAN = sys.platform.startswith("linux")
_LOWBIT = bytes(i & 1 for i in range(256))


def map_for_residency(fd: int, size: int) -> int:
    """The address of an untouched read-only mapping of the file (0 when it cannot be made)."""
    if not size:
        return 0
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    return 0 if addr in (None, _MAP_FAILED) else int(addr)


def unmap(addr: int, size: int) -> None:
    if addr:
        _libc.munmap(addr, size)


class ResidencyProbe:
    """mincore over mapped files, with one vector per calling thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _vector(self, n: int) -> tuple[bytearray, int]:
        """This thread's mincore vector (at least `n` bytes) and its address."""
        loc = self._local
        vec = getattr(loc, "vec", None)
        if vec is None or len(vec) < n:
            vec = bytearray(max(n, 1024))
            loc.cvec = (ctypes.c_char * len(vec)).from_buffer(vec)  # keeps the address valid
            loc.vec, loc.vaddr = vec, ctypes.addressof(loc.cvec)
        return vec, loc.vaddr

    def _mincore(self, addr: int, g0: int, g1: int) -> bytearray:
        """The residency vector of pages [g0, g1) of the file mapped at `addr`: bit 0 of
        byte i says page g0 + i is resident (only those bytes are meaningful)."""
        vec, vaddr = self._vector(g1 - g0)
        call = _mincore_holding_gil if g1 - g0 <= HOLD_GIL_PAGES else _libc.mincore
        if call(addr + g0 * PAGE, (g1 - g0) * PAGE, vaddr) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore failed: {os.strerror(err)}")
        return vec if _MINCORE_CLEAN else vec[:g1 - g0].translate(_LOWBIT)

    def resident_pages(self, addr: int, ranges: list[tuple[int, int]]) -> tuple[int, int]:
        """(resident pages, total pages) over `ranges` of the file mapped at `addr`. A page
        shared by two ranges counts once per range. (0, 0) when there is no mapping; a failed
        mincore raises OSError (it must never read as "nothing resident": that is a cold
        premise nobody checked)."""
        if not addr:
            return 0, 0
        if len(ranges) == 1:  # a bundle's span (engine.store): no merging to do
            off, length = ranges[0]
            g0, g1 = off // PAGE, -(-(off + length) // PAGE)
            vec = self._mincore(addr, g0, g1)
            return vec.count(1, 0, g1 - g0), g1 - g0
        spans = sorted((off // PAGE, -(-(off + length) // PAGE)) for off, length in ranges)
        resident = total = 0
        i = 0
        while i < len(spans):
            g0, g1 = spans[i]
            j = i + 1
            while j < len(spans) and spans[j][0] - g1 <= MERGE_GAP_PAGES:
                g1 = max(g1, spans[j][1])
                j += 1
            vec = self._mincore(addr, g0, g1)
            for p0, p1 in spans[i:j]:
                resident += vec.count(1, p0 - g0, p1 - g0)
                total += p1 - p0
            i = j
        return resident, total
