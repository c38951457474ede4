"""One contiguous byte range of a file read into writable buffers (a run of engine.read_plan:
the buffers take its bytes in order), with one vectored read, three ways: buffered (`preadv`),
first without waiting (`RWF_NOWAIT`: only what the page cache holds), and uncached (O_DIRECT
through a page-aligned bounce buffer, then one copy per buffer: MLX buffers are not page
aligned). Plain functions over file descriptors; the store (engine.store) chooses which and
names the file in errors."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from contract.thresholds import ALIGN  # O_DIRECT alignment of offset, length, buffer
from engine.platform import libc_holding_gil
from engine.read_plan import tail


class RangeReadError(Exception):
    """A failed or short read; the message says what happened, the caller says where."""


class DirectRefused(Exception):
    """The filesystem refused an O_DIRECT read (EINVAL on its first read): read buffered."""


def read_buffered(fd: int, off: int, length: int, views: list, size: int,
                  done: int = 0) -> None:
    """Read `length` bytes at `off` into `views` (in order; their sizes sum to `length`), the
    first `done` of them already there: one `preadv`, more only after a short read."""
    while done < length:
        try:
            n = os.preadv(fd, tail(views, done) if done else views, off + done)
        except OSError as err:
            raise RangeReadError(err.strerror or str(err)) from None
        if n == 0:
            raise RangeReadError(_short(fd, off + done, size))
        done += n


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


# preadv called holding the GIL: for a copy out of the page cache of a small bundle.
# os.preadv releases the GIL around every call; a reader taking it back waits while the main
# thread builds graphs (up to the interpreter's switch interval), far longer than the copy.
_preadv_holding_gil = getattr(libc_holding_gil, "preadv", None)
if _preadv_holding_gil is not None:
    _preadv_holding_gil.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                    ctypes.c_longlong]
    _preadv_holding_gil.restype = ctypes.c_ssize_t
# RWF_NOWAIT's read never waits for the device: it may keep the GIL for any bundle it copies
_preadv2_holding_gil = getattr(libc_holding_gil, "preadv2", None)
if _preadv2_holding_gil is not None:
    _preadv2_holding_gil.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_longlong, ctypes.c_int]
    _preadv2_holding_gil.restype = ctypes.c_ssize_t


def iovec_array(views: list) -> object:
    """`views` (NumPy arrays, in order) as a C iovec array for `read_warm`; None where libc has
    no preadv. The array points into the views: keep them alive as long as it is used."""
    if _preadv_holding_gil is None:
        return None
    return (_Iovec * len(views))(*[(v.ctypes.data, v.nbytes) for v in views])


def read_warm(fd: int, off: int, length: int, views: list, iovecs, size: int) -> None:
    """`read_buffered` for a range the page cache holds, without releasing the GIL: one
    `preadv` of the iovec array `iovecs` (the same buffers as `views`). A failed read raises
    RangeReadError; a short one is finished (or named) by `read_buffered`."""
    n = _preadv_holding_gil(fd, ctypes.addressof(iovecs), len(iovecs), off)
    if n < 0:
        raise RangeReadError(os.strerror(ctypes.get_errno()))
    if n != length:
        read_buffered(fd, off, length, views, size, n)


def _short(fd: int, at: int, expected: int) -> str:
    """A short read, with the file's size now (not the size it had when opened)."""
    try:
        now = os.fstat(fd).st_size
    except OSError:
        now = -1
    return (f"short read at byte {at} (the file has {now} bytes, {expected} expected; "
            "truncated?)")


def read_nowait(fd: int, off: int, views: list, flag: int, iovecs=None) -> int:
    """Read what the page cache holds of the range without waiting for the device (`flag`:
    RWF_NOWAIT; Linux 6.18 still starts the refused pages' reads: engine.store). Returns the
    bytes read: the range's length when all of it was cached. With `iovecs` (the views as a C
    iovec array) libc's preadv2 does it holding the GIL."""
    if iovecs is not None and _preadv2_holding_gil is not None:
        n = _preadv2_holding_gil(fd, ctypes.addressof(iovecs), len(iovecs), off, flag)
        if n >= 0:
            return n
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            raise RangeReadError(os.strerror(err))
        return 0
    try:
        return os.preadv(fd, views, off, flag)
    except OSError as err:
        if err.errno != errno.EAGAIN:
            raise RangeReadError(err.strerror or str(err)) from None
        return 0


def bounce_buffer(held: mmap.mmap | None, n: int) -> mmap.mmap:
    """`held` when it has room for `n` bytes, else a new page-aligned one (anonymous maps are)."""
    if held is None or len(held) < n:
        return mmap.mmap(-1, max(n, 1 << 20))
    return held


def read_direct(dfd: int, off: int, length: int, views: list, size: int,
                bounce: mmap.mmap) -> None:
    """Read the range through O_DIRECT into `bounce` (>= the range rounded out to ALIGN),
    then copy it into `views` in order. Raises DirectRefused when the filesystem refuses
    O_DIRECT."""
    a0 = off - off % ALIGN
    a1 = -(-(off + length) // ALIGN) * ALIGN
    mv = memoryview(bounce)
    try:
        done = 0
        while done < off + length - a0:
            try:
                n = os.preadv(dfd, [mv[done:a1 - a0]], a0 + done)
            except OSError as err:
                if err.errno == errno.EINVAL and done == 0:
                    raise DirectRefused(err.strerror or str(err)) from None
                raise RangeReadError(err.strerror or str(err)) from None
            if n == 0:
                raise RangeReadError(_short(dfd, a0 + done, size))
            done += n
        pos = off - a0
        for view in views:
            dest = memoryview(view).cast("B")
            dest[:] = mv[pos: pos + dest.nbytes]
            pos += dest.nbytes
    finally:
        mv.release()


def aligned_span(off: int, length: int) -> int:
    """Bytes of the range rounded out to ALIGN at both ends (the bounce buffer it needs)."""
    return -(-(off + length) // ALIGN) * ALIGN - (off - off % ALIGN)
