"""Which byte ranges of a file go into one vectored read. No MLX.

A read is asked as segments (file offset, destination buffer), each buffer exactly as long as
its range. Segments that follow each other in the file form a run: one `preadv` whose iovecs
are their buffers, so the bytes go from the page cache or the device straight into the
destinations with one system call and, cold, one device request. A gap of at most `max_gap`
bytes between two segments (the padding that aligns a bundle, always under ALIGN) joins the run
through a scratch buffer, read and thrown away; a larger gap starts a new run (so a stacked
layout's bundle stays one read per tensor, as it was). A run holds at most `iov_max`
iovecs (the kernel's IOV_MAX: a longer one would fail with EINVAL).

One bundle of the bundled layout is one run; one bundle of the stacked layout is one run per
tensor; a whole layer of the bundled layout is ceil(iovecs / IOV_MAX) runs.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import numpy as np

from contract.errors import BadInput
from contract.thresholds import ALIGN

try:
    IOV_MAX = int(os.sysconf("SC_IOV_MAX"))
except (AttributeError, OSError, ValueError):  # not every platform names it
    IOV_MAX = 1024
if IOV_MAX <= 0:
    IOV_MAX = 1024
MAX_GAP = ALIGN  # a bundle's alignment padding is read through; anything larger is not


@dataclass
class Run:
    offset: int
    buffers: list = field(default_factory=list)  # writable, C-contiguous (NumPy arrays or
    # memoryviews: anything with .nbytes), in file order
    length: int = 0
    iovecs: object = None  # the buffers as a C iovec array (a ReadTarget's), when built

    def add(self, buf) -> None:
        self.buffers.append(buf)
        self.length += buf.nbytes


class ReadTarget(dict):
    """A bundle's destination buffers (tensor name -> writable C-contiguous array) that take
    many reads: a staged slot's row, a hot-pool row. The store checks them against a layer's
    slices on the first read and keeps them in file order (`checked`), instead of on every
    read."""

    __slots__ = ("checked", "iovecs")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # (the layer's (name, slice bytes) in file order, the views in that order)
        self.checked: tuple[tuple, list] | None = None
        self.iovecs: object = None  # the views as a C iovec array (engine.range_reads)

    def __setitem__(self, name: str, buffer) -> None:
        """A buffer replaced (by item assignment; `update` bypasses this): checked again on
        the next read."""
        super().__setitem__(name, buffer)
        self.checked = self.iovecs = None


class _Scratch(threading.local):
    """Per-thread throwaway buffer for the gaps a run reads through."""

    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)

    def take(self, n: int) -> np.ndarray:
        if self.buf.nbytes < n:
            self.buf = np.empty(max(n, 4096), np.uint8)
        return self.buf[:n]


_scratch = _Scratch()


def plan(segments: list[tuple[int, object]], iov_max: int = IOV_MAX,
         max_gap: int = MAX_GAP) -> list[Run]:
    """Runs covering `segments` [(offset, buffer)], which must be in ascending file order and
    not overlap. Each run is one vectored read."""
    if iov_max < 1:
        raise BadInput(f"read plan: iov_max must be >= 1, got {iov_max}")
    runs: list[Run] = []
    end = -1
    for offset, buf in segments:
        nbytes = buf.nbytes
        gap = offset - end
        cur = runs[-1] if runs else None
        joins = cur is not None and 0 <= gap <= max_gap and \
            len(cur.buffers) + (1 if gap else 0) < iov_max
        if gap < 0 and cur is not None:
            raise ValueError(f"read plan: segment at {offset} overlaps or precedes the one "
                             f"ending at {end}")
        if joins:
            if gap:
                cur.add(_scratch.take(gap))
            cur.add(buf)
        else:
            run = Run(offset)
            run.add(buf)
            runs.append(run)
        end = offset + nbytes
    return runs


def tail(buffers: list, done: int) -> list:
    """The iovecs left of `buffers` after their first `done` bytes (to finish a short read)."""
    out = []
    for buf in buffers:
        n = buf.nbytes
        if done >= n:
            done -= n
            continue
        out.append(memoryview(buf).cast("B")[done:] if done else buf)
        done = 0
    return out
