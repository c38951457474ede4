"""The quantized expert kernel's rate on a model's bundles.

A call streams K bundles of weights. Small bundles stay in the CPU's caches between calls;
wide ones run at memory's speed, so the rate depends on the bundle's size. calibrate measures
the rate on the calibration model's own bundles (expert_gbps) and, on synthetic experts of
scaled width, at several sizes from that model's up (calibration.expert_size_probe: hardware
expert_size_bytes / _gbps). Here the curve's shape carries expert_gbps to the model's
bundle_bytes: a synthetic stack need not run as fast as the real one of the same size, and the
two probes run at different moments of a machine whose speed drifts, so the curve is read as
ratios to its first size, where expert_gbps was measured (reports/transfer/expert-kernel:
the real kernels of two models against the curve)."""

from __future__ import annotations

from sim.rate_curve import rate_at
from sim.scenario import Hardware


def expert_gbps(hw: Hardware, bundle_bytes: float) -> float:
    """The kernel's rate (GB/s of bundle bytes) on bundles of `bundle_bytes`: expert_gbps
    times the size curve's rate there over its rate at its first size; the curve alone where
    expert_gbps is 0, expert_gbps alone without a curve (0: the roofline's
    mem_bandwidth_gbps)."""
    sizes, rates = hw.expert_size_bytes, hw.expert_size_gbps
    if not sizes:
        return hw.expert_gbps
    at = rate_at(sizes, rates, bundle_bytes)
    return hw.expert_gbps * at / rates[0] if hw.expert_gbps else at
