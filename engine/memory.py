"""Cheap memory readers for the per-step trace columns (each well under 2 us):
MLX allocator active/peak bytes and the process's resident set size.

- `mx.get_active_memory()` / `mx.get_peak_memory()` / `mx.reset_peak_memory()` are the mlx 0.32
  names (the older `mx.metal.*` ones are gone). Peak is process-wide: whoever resets it changes
  what everyone else reads.
- RSS comes from /proc/self/statm (field 2, pages) read with one `pread` on a kept-open fd;
  elsewhere `resource.getrusage` only gives the maximum RSS, so we return -1 ("unknown")."""

from __future__ import annotations

import mmap
import os

import mlx.core as mx

PAGE = mmap.PAGESIZE
# (pid, fd): /proc/self resolves when opened, so a forked child reopens it.
_statm: tuple[int, int] | None = None


def mlx_active_bytes() -> int:
    return int(mx.get_active_memory())


def mlx_peak_bytes() -> int:
    return int(mx.get_peak_memory())


def reset_mlx_peak() -> None:
    mx.reset_peak_memory()


def rss_bytes() -> int:
    """Current resident set size of this process in bytes, -1 when unknown."""
    global _statm
    try:
        if _statm is None or _statm[0] != os.getpid():
            fd = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            _statm = (os.getpid(), fd)
        return int(os.pread(_statm[1], 256, 0).split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return -1
