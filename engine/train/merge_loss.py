"""How much of an adapter survives merging into the int4 base (edge0 paper digest, section 3):

    survival = 1 - |U - M| / |U - B|

U is the unmerged model (int4 base + the LoRA delta computed in parallel), M the merged one
(base + delta, re-quantized to int4: what a merged checkpoint serves), B the base. Measured
at weight level per module kind (Frobenius norms over every module of that kind) and at logit
level on held-out text, routing by the heads as served. A delta below the 4-bit group step
rounds back to the base: survival near 0.

The base is the deployed int4 checkpoint. A projection the converted model serves in float
(the fixtures keep their resident part float) is quantized first, at the experts' bits and
group size, so B, U and M are those of an int4 deployment of it; a projection served
quantized is merged at its own bits and group size (mlx-lm's `LoRALinear.fuse`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from engine.lora import adapters


def kind_of(path: str) -> str:
    """'model.layers.3.self_attn.q_proj' -> 'self_attn.q_proj'."""
    parts = path.split(".")
    return ".".join(parts[parts.index("layers") + 2:])


def quantize_bases(model: nn.Module, bits: int, group_size: int) -> None:
    """Give every adapted float projection an int4 base (the deployed checkpoint's)."""
    for m in adapters(model).values():
        if not isinstance(m.linear, nn.QuantizedLinear):
            m.linear = nn.QuantizedLinear.from_linear(m.linear, group_size, bits)
    mx.eval(model.parameters())


def merge(model: nn.Module) -> None:
    """Merge each adapter into its (quantized) base and re-quantize: mlx-lm's fuse."""
    model.update_modules(tree_unflatten([(p, m.fuse()) for p, m in adapters(model).items()]))
    mx.eval(model.parameters())


def _dequantized(lin: nn.QuantizedLinear) -> np.ndarray:
    w = mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=lin.group_size,
                      bits=lin.bits, mode=lin.mode)
    return np.array(w, dtype=np.float64)


def weight_survival(model: nn.Module) -> dict[str, dict]:
    """Per module kind: survival, RMS of the delta, RMS of the base's quantization step."""
    acc: dict[str, dict[str, float]] = {}
    for path, m in adapters(model).items():
        base = m.linear  # quantized (quantize_bases first)
        b = _dequantized(base)
        delta = m.scale * (np.array(m.lora_a, np.float64) @ np.array(m.lora_b, np.float64)).T
        u = b + delta
        wq, s, z = mx.quantize(mx.array(u.astype(np.float32)), group_size=base.group_size,
                               bits=base.bits)
        merged = np.array(mx.dequantize(wq, s, z, group_size=base.group_size, bits=base.bits),
                          np.float64)
        step = np.array(base.scales, np.float64)
        a = acc.setdefault(kind_of(path), dict.fromkeys(("lost", "delta", "step", "steps",
                                                         "weights", "modules"), 0.0))
        a["lost"] += float(((u - merged) ** 2).sum())
        a["delta"] += float((delta ** 2).sum())
        a["step"] += float((step ** 2).sum())
        a["steps"] += step.size
        a["weights"] += delta.size
        a["modules"] += 1
    out = {}
    for kind, a in sorted(acc.items()):
        out[kind] = {"modules": int(a["modules"]),
                     "survival": 1.0 - (a["lost"] / a["delta"]) ** 0.5 if a["delta"] else None,
                     "delta_rms": (a["delta"] / a["weights"]) ** 0.5,
                     "step_rms": (a["step"] / a["steps"]) ** 0.5}
    return out


def logit_survival(unmerged: nn.Module, merged: nn.Module, base: nn.Module, logits_of,
                   batches) -> float:
    """1 - |U - M| / |U - B| over the logits of every position of `batches`."""
    lost = effect = 0.0
    for x in batches:
        u, m, b = (np.array(logits_of(model, x), np.float64) for model in
                   (unmerged, merged, base))
        lost += float(((u - m) ** 2).sum())
        effect += float(((u - b) ** 2).sum())
    return 1.0 - (lost / effect) ** 0.5 if effect > 0 else float("nan")
