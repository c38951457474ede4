"""A rate measured at a few sizes, read at another: time per byte interpolated linearly in
log2 of the size, held at the curve's ends (sim.zero_fill, sim.expert_kernel)."""

from __future__ import annotations

import math


def rate_at(sizes: list[float], rates: list[float], size: float) -> float:
    """The rate at `size` from `rates` measured at ascending `sizes` (one per size)."""
    if size <= sizes[0]:
        return rates[0]
    for i in range(1, len(sizes)):
        if size <= sizes[i]:
            share = math.log2(size / sizes[i - 1]) / math.log2(sizes[i] / sizes[i - 1])
            return 1.0 / ((1 - share) / rates[i - 1] + share / rates[i])
    return rates[-1]
