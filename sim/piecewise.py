"""A measured curve read between its points: linear between them, flat beyond the ends (as
numpy.interp, without an array per call: the curves are read once per CPU job or fill)."""

from __future__ import annotations

from bisect import bisect_left


def linear(xs: list[float], ys: list[float], x: float) -> float:
    """ys at x, xs ascending and not empty."""
    i = bisect_left(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)
