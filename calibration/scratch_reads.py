"""Reads of calibrate's scratch file that the storage and reclaim probes share: a whole range
into a buffer, and offsets for reads at random places."""

from __future__ import annotations

import os

import numpy as np

from contract.thresholds import ALIGN


def pread_all(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from `fd` at `offset` (preadv until done; a short file is an error)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at {offset + done}")
        done += n


def random_offsets(rng: np.random.Generator, file_bytes: int, size: int, n: int) -> list[int]:
    """n distinct non-overlapping aligned offsets for reads of `size` bytes."""
    slot = -(-size // ALIGN) * ALIGN
    slots = file_bytes // slot
    pick = rng.choice(slots, size=min(n, slots), replace=False)
    return [int(p) * slot for p in pick]
