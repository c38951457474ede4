"""How a checkpoint's routed experts become the stored ones (`convert`).

- A quantized checkpoint keeps its own quantization: the packed weights are copied byte for
  byte, in whatever mode MLX's `gather_qmm` runs (affine 2-8 bits at any group size, mxfp4,
  mxfp8, nvfp4). Re-quantizing mxfp4 to affine int4 would change the model the user chose, so
  it happens only when asked (`convert --requantize`), and the manifest says so.
- A float checkpoint (or `--requantize`) is quantized the mlx-lm way: `mx.quantize` on the
  stacked [E, out, in] tensor, which is what `SwitchLinear.to_quantized` does, so a resident
  mlx-lm model quantized with the same settings holds the same numbers.
- Float scales, affine biases and expert linear biases (gpt_oss) are written in the compute
  dtype the conversion targets (engine.device): float32 for MLX's CPU backend (bf16 scales are
  several times slower there: machine-notes; bf16 and f16 values are exact in float32), the
  checkpoint's own dtype for Metal and CUDA, as mlx-lm keeps them.

Everything here returns lazy arrays: `convert` evaluates and writes them one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contract.errors import BadInput
from engine.manifest import PROJECTIONS, expert_tensor_names

DEFAULT_BITS, DEFAULT_GROUP_SIZE = 4, 64


@dataclass(frozen=True)
class ExpertQuant:
    """The stored experts' quantization, and how it came about."""

    mode: str
    bits: int
    group_size: int
    requantized: bool  # the checkpoint's own quantized experts were dequantized and redone
    upcast: bool  # float scales and biases written as float32

    @property
    def affine(self) -> bool:
        return self.mode == "affine"

    def names(self, linear_bias: bool) -> tuple[str, ...]:
        return expert_tensor_names(self.affine, linear_bias)


def plan(sw, bits: int | None, group_size: int | None, requantize: bool, upcast: bool,
         where: Path) -> ExpertQuant:
    """The target quantization for experts whose skeleton SwitchLinear is `sw` (quantized like
    the source when the source is). `bits` / `group_size` None: the checkpoint's own, or 4 / 64
    for a float checkpoint. Raises BadInput when asked to change a quantized checkpoint's
    quantization without --requantize, or for a mode the kernels cannot run."""
    source_mode = getattr(sw, "mode", None) if hasattr(sw, "scales") else None
    if source_mode is not None and getattr(sw, "global_scale", None) is not None:
        raise BadInput(f"{where}: experts with a global scale ({sw.mode}) are not supported")
    if source_mode is not None and not requantize:
        own = (sw.bits, sw.group_size)
        if (bits or own[0], group_size or own[1]) != own:
            raise BadInput(f"{where}: the experts are already quantized ({source_mode}, "
                           f"{own[0]}-bit, group {own[1]}); --bits/--group-size change that "
                           "only with --requantize")
        q = ExpertQuant(source_mode, sw.bits, sw.group_size, False, upcast)
    else:
        q = ExpertQuant("affine", bits or DEFAULT_BITS, group_size or DEFAULT_GROUP_SIZE,
                        source_mode is not None, upcast)
    check_runnable(q, where)
    return q


def check_runnable(q: ExpertQuant, where: Path) -> None:
    """Raise BadInput unless MLX quantizes and runs `gather_qmm` in this mode on this device."""
    import mlx.core as mx

    try:
        w = mx.random.normal((2, 32, 256), key=mx.random.key(0))
        packed, scales, *biases = mx.quantize(w, q.group_size, q.bits, mode=q.mode)
        y = mx.gather_qmm(mx.ones((1, 1, 1, 256)), packed, scales, biases[0] if biases else None,
                          rhs_indices=mx.array([[1]], mx.uint32), transpose=True,
                          group_size=q.group_size, bits=q.bits, mode=q.mode)
        mx.eval(y)
    except (ValueError, RuntimeError) as err:
        msg = " ".join(str(err).split())[:200]
        raise BadInput(f"{where}: experts quantized {q.mode} {q.bits}-bit group "
                       f"{q.group_size}: MLX's kernels cannot run that here ({msg})") from None


def layer_tensors(weights: dict, prefix: str, sw, q: ExpertQuant) -> dict:
    """{stored name: lazy array} of one MoE layer in file order, popping the layer's source
    tensors (`prefix` = the SwitchGLU's parameter prefix) out of `weights`."""
    import mlx.core as mx

    def floats(a):
        return a.astype(mx.float32) if q.upcast and mx.issubdtype(a.dtype, mx.floating) else a

    out: dict = {}
    linear_bias = f"{prefix}.{PROJECTIONS[0]}.bias" in weights
    for proj in PROJECTIONS:
        key = f"{prefix}.{proj}"
        lin = getattr(sw, proj)
        w = weights.pop(f"{key}.weight")
        scales = weights.pop(f"{key}.scales", None)
        biases = weights.pop(f"{key}.biases", None)
        if scales is not None and not q.requantized:  # kept as the checkpoint has it
            out[f"{proj}.weight"], out[f"{proj}.scales"] = w, floats(scales)
            if q.affine:
                out[f"{proj}.biases"] = floats(biases)
        else:
            if scales is not None:
                w = mx.dequantize(w, scales, biases, lin.group_size, lin.bits, mode=lin.mode)
            packed, s, b = mx.quantize(w.astype(mx.float32) if q.upcast else w, q.group_size,
                                       q.bits)
            out[f"{proj}.weight"], out[f"{proj}.scales"], out[f"{proj}.biases"] = packed, s, b
        if linear_bias:
            out[f"{proj}.bias"] = floats(weights.pop(f"{key}.bias"))
    assert tuple(out) == q.names(linear_bias)
    return out


def manifest_entry(q: ExpertQuant, scales_dtype: str) -> dict:
    """The manifest's `quantization`: mode, bits, group size, the scales' stored dtype and
    whether the checkpoint's own quantized experts were redone."""
    return {"bits": q.bits, "group_size": q.group_size, "mode": q.mode,
            "scales_dtype": scales_dtype, "requantized": q.requantized}
