"""The math contract, one function: y_k = down(silu(gate(x)) * up(x)) for each routed expert k,
over stacked quantized experts, with `mx.gather_qmm`. Every execution path (exact, staged, hot,
whole-layer) calls `switch_glu`; paths differ only in which experts the stacked tensors hold and
how routed expert ids map to their rows (`local_inds`).

The op sequence is mlx-lm's `SwitchGLU` with `QuantizedSwitchLinear` (including its sort for
large index sets and its compiled `swiglu`), so a path whose rows hold the same experts gives
the same floats as the fully resident mlx-lm model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu

from engine.manifest import TENSOR_NAMES

MX_DTYPES = {"uint32": mx.uint32, "float32": mx.float32}


class ExpertPath(Protocol):
    """An execution path for one MoE layer's routed experts. `x` [..., D] (the block's input),
    `inds` [..., K] routed expert ids (an MLX array, possibly not evaluated yet). Returns the
    unweighted expert outputs [..., K, D], computed with `switch_glu`; the MoE block applies the
    routing weights and the shared expert."""

    name: str

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array: ...


@dataclass(frozen=True)
class Quant:
    group_size: int = 64
    bits: int = 4
    mode: str = "affine"


def _qmm(x, w, s, b, idx, q: Quant, sorted_indices: bool) -> mx.array:
    return mx.gather_qmm(
        x, w, s, b, rhs_indices=idx, transpose=True, group_size=q.group_size, bits=q.bits,
        mode=q.mode, sorted_indices=sorted_indices,
    )


def switch_glu(x: mx.array, experts: dict[str, mx.array], local_inds: mx.array,
               quant: Quant) -> mx.array:
    """x [..., D], experts: the 9 stacked tensors (TENSOR_NAMES) with rows [N, ...],
    local_inds [..., K] row numbers into them. Returns the unweighted expert outputs [..., K, D]."""
    x = mx.expand_dims(x, (-2, -3))
    inds = mx.stop_gradient(local_inds)
    do_sort = inds.size >= 64
    idx, inv_order = inds, None
    if do_sort:  # mlx-lm's _gather_sort: group tokens by expert for large batches (prefill)
        m = inds.shape[-1]
        flat = inds.flatten()
        order = mx.argsort(flat)
        inv_order = mx.argsort(order)
        x, idx = x.flatten(0, -3)[order // m], flat[order]
    e = experts
    x_up = _qmm(x, e["up_proj.weight"], e["up_proj.scales"], e["up_proj.biases"], idx, quant,
                do_sort)
    x_gate = _qmm(x, e["gate_proj.weight"], e["gate_proj.scales"], e["gate_proj.biases"], idx,
                  quant, do_sort)
    x = _qmm(swiglu(x_gate, x_up), e["down_proj.weight"], e["down_proj.scales"],
             e["down_proj.biases"], idx, quant, do_sort)
    if do_sort:
        x = mx.unflatten(x[inv_order], 0, inds.shape)
    return x.squeeze(-2)


def alloc_stack(shapes: dict[str, tuple[tuple[int, ...], str]], rows: int
                ) -> tuple[dict[str, mx.array], dict[str, np.ndarray]]:
    """Fresh stacked MLX buffers with `rows` expert rows for the 9 tensors, plus writable NumPy
    views of them (zero-copy) that `ExpertStore.read_bundle` reads into: row r of tensor n is
    `views[n][r]`. `shapes` is `ExpertStore.expert_shapes(layer)`."""
    arrays = {n: mx.zeros((rows, *shapes[n][0]), dtype=MX_DTYPES[shapes[n][1]])
              for n in TENSOR_NAMES}
    mx.eval(list(arrays.values()))
    return arrays, {n: np.asarray(a) for n, a in arrays.items()}


def row_views(views: dict[str, np.ndarray], row: int) -> dict[str, np.ndarray]:
    """The 9 per-expert views of stack row `row` (what `read_bundle` takes as `into`)."""
    return {n: v[row] for n, v in views.items()}
