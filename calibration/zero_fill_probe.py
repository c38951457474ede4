"""How fast MLX zero-fills the exact path's fresh stack, against how much memory was touched
since its buffer was last used (sim keys zero_fill_rotation_mib, zero_fill_rotation_gbps).

The exact path allocates a zeroed stack per call (engine.paths.kernel.alloc_stack) and MLX's
allocator hands back a buffer a previous step freed. Whether that buffer is still in the CPU's
caches decides the fill's speed: a small model's stacks are (a step touches a few MiB), a
large model's are not. So the fill is timed with a rotation of live stacks:
ROTATIONS_MIB of stacks are kept alive and the oldest freed before each new one, so every
allocation reuses a buffer last touched that many MiB ago. At each rotation a stack of about
2 MiB of the model's first MoE layer is timed, less a one-bundle call (the per-call cost: the
eval's round trip), over the bytes between them: the time per byte."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.store import ExpertStore

ROTATIONS_MIB = (4, 8, 16, 32, 64, 128, 256)
STACK_MIB = 2.0  # the stack timed at each rotation (about; whole bundles)
TIMED = 40  # allocations timed a measurement, once the rotation is full
REPS = 3  # each measurement this often, the rotations interleaved; medians


def _fill_ms(shapes: dict, rows: int, rotation_bytes: float, stack_bytes: int) -> float:
    """Median ms of alloc_stack at `rows`, each call reusing a buffer freed after
    `rotation_bytes` of other stacks were allocated."""
    from engine.paths.kernel import alloc_stack

    keep = max(0, round(rotation_bytes / stack_bytes) - 1)  # alive when the next one comes
    alive: list[Any] = []
    times = []
    for i in range(keep + 1 + TIMED):
        alive = alive[max(0, len(alive) - keep):] if keep else []  # the oldest freed first
        t0 = time.perf_counter_ns()
        arrays, _ = alloc_stack(shapes, rows)
        if i > keep:
            times.append(time.perf_counter_ns() - t0)
        alive.append(arrays)
        del arrays
    return float(np.median(times)) / 1e6


def zero_fill_curve(converted: Path, rotations_mib: tuple[int, ...] = ROTATIONS_MIB
                    ) -> list[tuple[float, float]]:
    """(rotation MiB, ms per MiB filled) for each rotation where the stack took longer than
    the one-bundle call (its per-call cost, the eval's round trip); a rotation where it did
    not (noise) is left out."""
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    with ExpertStore(manifest) as store:
        shapes = store.expert_shapes(manifest.moe_layers[0])
    bundle = manifest.bundle_bytes
    rows = max(2, round(STACK_MIB * 2**20 / bundle))
    stack = rows * bundle
    _fill_ms(shapes, rows, stack, stack)  # warm-up: MLX's allocator and the compute thread
    calls: list[float] = []
    runs: dict[int, list[float]] = {mib: [] for mib in rotations_mib}
    for _ in range(REPS):
        calls.append(_fill_ms(shapes, 1, bundle, bundle))
        for mib in rotations_mib:
            runs[mib].append(_fill_ms(shapes, rows, mib * 2**20, stack))
    call = float(np.median(calls))
    out = []
    for mib, times in runs.items():
        per_mib = (float(np.median(times)) - call) / ((stack - bundle) / 2**20)
        if per_mib > 0:
            out.append((float(mib), per_mib))
    return out
