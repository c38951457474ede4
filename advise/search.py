"""The search: every candidate when the space is small, else a coordinate search.

Coordinate search (documented, not exhaustive): each (arm, K) line starts at the engine's
defaults (hot pool 25% of the experts, headroom K, the calibrated reads in flight, LRU); then
axis by axis (hot pool, headroom, readers, cache policy) every value of that axis is tried
with the line's other axes at their best so far, and the best is kept; passes repeat until
no line's best changes (at most MAX_PASSES). The lines advance together, so each batch has
as many points as there are lines times values: the workers stay busy. It finds the best of
each axis given the others, which misses only an optimum that needs two axes to move at
once; an exhaustive run (`--exhaustive-limit`) checks that on a given model and machine."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from advise.space import AXES, Candidate, Space

MAX_PASSES = 3
EXHAUSTIVE_LIMIT = 400  # candidates: above it, the coordinate search

Predict = Callable[[list[Candidate]], list[dict[str, Any]]]
Score = Callable[[dict[str, Any]], float]


def search(space: Space, predict: Predict, score: Score,
           exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> tuple[str, dict[Candidate, dict]]:
    """(how it searched, candidate -> simulated row) for every candidate evaluated. `score`
    ranks a row (higher is better; -inf: not allowed, e.g. over the memory ceiling)."""
    if space.size() <= exhaustive_limit:
        cands = [c for arm, k in space.lines() for c in space.every(arm, k)]
        return "exhaustive", dict(zip(cands, predict(cands), strict=True))
    seen: dict[Candidate, dict] = {}

    def run(cands: list[Candidate]) -> None:
        fresh = list(dict.fromkeys(c for c in cands if c not in seen))
        seen.update(zip(fresh, predict(fresh), strict=True))

    best = {line: space.default(*line) for line in space.lines()}
    run(list(best.values()))
    passes, changed = 0, True
    while changed and passes < MAX_PASSES:
        passes += 1
        changed = False
        for axis in AXES:
            tries = {line: [replace(best[line], **{axis: v})
                            for v in space.axes(*line).get(axis, [])] for line in best}
            run([c for cs in tries.values() for c in cs])
            for line, cands in tries.items():
                if not cands:
                    continue
                top = max(cands, key=lambda c: _key(score, seen[c]))
                if _key(score, seen[top]) > _key(score, seen[best[line]]):
                    best[line], changed = top, True
    return (f"coordinate search ({len(seen)} of {space.size()} candidates, {passes} "
            f"pass{'es' if passes != 1 else ''})"), seen


def _key(score: Score, row: dict[str, Any]) -> float:
    if row.get("status") != "ok":
        return -math.inf
    value = score(row)
    return value if value is not None and math.isfinite(value) else -math.inf
