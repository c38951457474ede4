"""The math contract, one function: y_k = down(act(gate(x), up(x))) for each routed expert k,
over stacked quantized experts, with `mx.gather_qmm`. Every execution path (exact, staged, hot,
whole-layer) calls `switch_glu`; paths differ only in which experts the stacked tensors hold and
how routed expert ids map to their rows (`local_inds`).

`act` is SwiGLU, silu(g) * u, or gpt_oss's clipped variant (u + 1) * g * sigmoid(1.702 g).
Each projection may carry a bias added after its matmul (gpt_oss). The quantization is the
checkpoint's: affine (scales and biases) or a microscaling mode (mxfp4, mxfp8, nvfp4: scales
only).

The op sequence is mlx-lm's `SwitchGLU` with `QuantizedSwitchLinear` (including its sort for
large index sets and its compiled activations), so a path whose rows hold the same experts
gives the same floats as the fully resident mlx-lm model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu, swiglu_oai

from engine.read_plan import ReadTarget

MX_DTYPES = {"uint32": mx.uint32, "uint8": mx.uint8, "float32": mx.float32,
             "float16": mx.float16, "bfloat16": mx.bfloat16}
ACTIVATIONS = {"swiglu": swiglu, "swiglu_oai": swiglu_oai}  # act(gate, up)


class ExpertPath(Protocol):
    """An execution path for one MoE layer's routed experts. `x` [..., D] (the block's input),
    `inds` [..., K] routed expert ids (an MLX array, possibly not evaluated yet). Returns the
    unweighted expert outputs [..., K, D], computed with `switch_glu`; the MoE block applies the
    routing weights and the shared expert.

    Paths subclass this protocol, so the capabilities below have their defaults: a path that
    can do more says so (the staged path: `takes_predicted`), and callers ask the flag, not
    `hasattr`."""

    name: str
    # routing known ahead (a prerouter, a layer lead) runs through `predicted`, with no sync
    takes_predicted: bool = False

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array: ...

    def predicted(self, x: mx.array, inds: mx.array, early: bool = False) -> mx.array:
        """`inds` known ahead; only paths with `takes_predicted` run it differently."""
        return self(x, inds)

    def reset(self) -> None:
        """Settle reads in flight and drop what was queued (after a failed request)."""

    def forget(self) -> None:
        """Drop every expert the path keeps loaded (its file changed): all read again."""
        self.reset()


@dataclass(frozen=True)
class Quant:
    """How a layer's stacked experts are computed: their quantization and activation."""

    group_size: int = 64
    bits: int = 4
    mode: str = "affine"
    activation: str = "swiglu"  # ACTIVATIONS

    @classmethod
    def of(cls, manifest) -> Quant:
        from engine.archs import ARCHS

        q = manifest.quantization
        return cls(q["group_size"], q["bits"], q.get("mode", "affine"),
                   ARCHS[manifest.model_type].activation)


def _project(x, e: dict[str, mx.array], proj: str, idx, q: Quant, sorted_indices: bool
             ) -> mx.array:
    """One projection of mlx-lm's QuantizedSwitchLinear: gather_qmm, then its bias if any."""
    y = mx.gather_qmm(
        x, e[f"{proj}.weight"], e[f"{proj}.scales"], e.get(f"{proj}.biases"), rhs_indices=idx,
        transpose=True, group_size=q.group_size, bits=q.bits, mode=q.mode,
        sorted_indices=sorted_indices,
    )
    bias = e.get(f"{proj}.bias")
    if bias is not None:
        y = y + mx.expand_dims(bias[idx], -2)
    return y


def switch_glu(x: mx.array, experts: dict[str, mx.array], local_inds: mx.array,
               quant: Quant) -> mx.array:
    """x [..., D], experts: a layer's stacked tensors (LayerEntry.names) with rows [N, ...],
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
    x_up = _project(x, experts, "up_proj", idx, quant, do_sort)
    x_gate = _project(x, experts, "gate_proj", idx, quant, do_sort)
    x = _project(ACTIVATIONS[quant.activation](x_gate, x_up), experts, "down_proj", idx, quant,
                 do_sort)
    if do_sort:
        x = mx.unflatten(x[inv_order], 0, inds.shape)
    return x.squeeze(-2)


def alloc_stack(shapes: dict[str, tuple[tuple[int, ...], str]], rows: int
                ) -> tuple[dict[str, mx.array], dict[str, np.ndarray]]:
    """Fresh stacked MLX buffers with `rows` expert rows for a layer's tensors, plus writable
    NumPy views of them (zero-copy) that `ExpertStore.read_bundle` reads into: row r of tensor
    n is `views[n][r]`. `shapes` is `ExpertStore.expert_shapes(layer)`."""
    arrays = {n: mx.zeros((rows, *shape), dtype=MX_DTYPES[dt]) for n, (shape, dt) in
              shapes.items()}
    mx.eval(list(arrays.values()))
    return arrays, {n: _writable_view(a) for n, a in arrays.items()}


def _writable_view(a: mx.array) -> np.ndarray:
    """A zero-copy writable NumPy view of `a`. NumPy has no bfloat16: such a buffer is viewed
    as uint16 (an evaluated MLX view shares its source's memory); the store writes bytes."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)
    return np.asarray(a)


def row_views(views: dict[str, np.ndarray], row: int) -> dict[str, np.ndarray]:
    """The per-expert views of stack row `row` (what `read_bundle` takes as `into`)."""
    return {n: v[row] for n, v in views.items()}


def row_targets(views: dict[str, np.ndarray], rows: int) -> list[ReadTarget]:
    """Rows 0..rows-1 of a stack as read targets: rows that take many reads (slots, a pool),
    checked by the store once (engine.read_plan.ReadTarget)."""
    return [ReadTarget(row_views(views, r)) for r in range(rows)]
