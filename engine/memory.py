"""Cheap memory readers for the per-step trace columns (each well under 2 us):
MLX allocator active/peak bytes and the process's resident set size.

- `mx.get_active_memory()` / `mx.get_peak_memory()` / `mx.reset_peak_memory()` are the mlx 0.32
  names (the older `mx.metal.*` ones are gone). Peak is process-wide: whoever resets it changes
  what everyone else reads.
- RSS comes from engine.platform: Linux /proc/self/statm (field 2, pages) read with one `pread`
  on a kept-open fd; macOS getrusage's ru_maxrss (the peak, in bytes: what it has)."""

from __future__ import annotations

import mlx.core as mx

from engine import platform


def mlx_active_bytes() -> int:
    return int(mx.get_active_memory())


def mlx_peak_bytes() -> int:
    return int(mx.get_peak_memory())


def reset_mlx_peak() -> None:
    mx.reset_peak_memory()


def rss_bytes() -> int:
    """Resident set size of this process in bytes (engine.platform), -1 when unknown."""
    return platform.current().rss_bytes()
