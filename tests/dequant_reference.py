"""The independent reference of the math contract: NumPy float64 dequantization of the int4
experts and a per-token, per-expert SwiGLU loop. Shares no code with the engine."""

from __future__ import annotations

import numpy as np


def dequantize(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, group: int = 64,
               bits: int = 4) -> np.ndarray:
    """Affine dequantization: each uint32 packs 32/bits values, low bits first."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint64) * bits
    vals = (q.astype(np.uint64)[..., None] >> shifts) & ((1 << bits) - 1)
    vals = vals.reshape(*q.shape[:-1], q.shape[-1] * per).astype(np.float64)
    g = vals.reshape(*vals.shape[:-1], -1, group)
    w = g * scales.astype(np.float64)[..., None] + biases.astype(np.float64)[..., None]
    return w.reshape(vals.shape)


def swiglu_reference(x: np.ndarray, inds: np.ndarray, tensors: dict) -> np.ndarray:
    """y[t, j] = down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = inds[t, j], in float64."""
    w = {p: dequantize(tensors[f"{p}.weight"], tensors[f"{p}.scales"], tensors[f"{p}.biases"])
         for p in ("gate_proj", "up_proj", "down_proj")}
    x = x.astype(np.float64)
    out = np.zeros((*inds.shape, x.shape[-1]))
    for t in range(inds.shape[0]):
        for j, e in enumerate(inds[t]):
            g = w["gate_proj"][e] @ x[t]
            u = w["up_proj"][e] @ x[t]
            out[t, j] = w["down_proj"][e] @ (g / (1 + np.exp(-g)) * u)
    return out
