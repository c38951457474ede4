"""Where a decreasing function of one value crosses a target: the fits that run the sim itself
(sim.routing_fit) invert it this way."""

from __future__ import annotations

from collections.abc import Callable


def decreasing_root(f: Callable[[float], float], target: float, lo: float, hi: float,
                    steps: int) -> float:
    """x in [lo, hi] with f(x) = target, for f decreasing, by `steps` halvings."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
