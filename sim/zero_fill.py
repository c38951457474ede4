"""The exact path's fresh zeroed stack (engine.paths.kernel.alloc_stack): how fast MLX fills it.

MLX's allocator hands the exact path a buffer an earlier call freed. If the memory touched
since then fits in the CPU's caches the buffer is still there and the fill runs at cache speed;
a large model's step touches more (its stacks, the page-cache pages copied into them, the
resident weights), and the fill runs at memory's speed. calibrate measures the rate against
that rotation (calibration.zero_fill_probe: hardware zero_fill_rotation_mib / _gbps); here it
is read at the bytes one decode step of the exact path touches."""

from __future__ import annotations

from sim.rate_curve import rate_at
from sim.scenario import Hardware, ModelProfile


def step_touched_bytes(m: ModelProfile, k: int) -> float:
    """Bytes one decode step of the exact path touches between two uses of a stack's buffer:
    each layer's stack of K bundles, the page-cache pages read into it, the resident weights."""
    return 2.0 * m.layers * k * m.bundle_bytes + m.resident_bytes


def fill_gbps(hw: Hardware, touched_bytes: float) -> float:
    """The fill's rate with `touched_bytes` touched since the buffer's last use: the hardware's
    curve, its time per byte interpolated linearly in log2 of the rotation and held at its
    ends; without a curve zero_fill_gbps (0: not charged)."""
    if not hw.zero_fill_rotation_mib:
        return hw.zero_fill_gbps
    return rate_at(hw.zero_fill_rotation_mib, hw.zero_fill_rotation_gbps, touched_bytes / 2**20)
