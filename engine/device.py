"""Which MLX backend the engine runs on, and the float dtype it computes in there.

On MLX's CPU backend the engine computes in float32: bf16 matmuls are 6-8x slower there and
float32 expert scales several times faster (machine-notes). On Metal and CUDA it keeps the
checkpoint's own float dtype for activations, scales and biases, as mlx-lm does. `dtype`
"auto" picks by backend; "float32" and "source" force one or the other (tests use "source" on
the CPU to run the accelerator's arithmetic)."""

from __future__ import annotations

from contract.engine_config import DTYPES
from contract.errors import BadInput

DEVICES = ("cpu", "gpu")


def backend() -> str:
    """"cpu" or "gpu" (Metal or CUDA): where MLX evaluates by default."""
    import mlx.core as mx

    return "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu"


def gpu_name() -> str | None:
    """"metal" or "cuda" when this MLX build has that backend and a device for it, else None."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def select(device: str) -> None:
    """Make `device` ("cpu" or "gpu") MLX's default; one line when there is no such backend."""
    import mlx.core as mx

    if device not in DEVICES:
        raise BadInput(f"--device {device!r}: unknown (one of: {', '.join(DEVICES)})")
    if device == "gpu" and gpu_name() is None:
        raise BadInput("--device gpu: this MLX build has no GPU backend on this machine "
                       "(no Metal device, no CUDA device); run with --device cpu")
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)


def upcasts(dtype: str = "auto") -> bool:
    """Whether float tensors are computed (and expert scales stored) as float32."""
    if dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype!r}: unknown (one of: {', '.join(DTYPES)})")
    return dtype == "float32" or (dtype == "auto" and backend() == "cpu")


def device_info(dtype: str = "auto") -> dict:
    """What run.json records: the backend it ran on, the GPU backend this build has, and the
    float dtype policy with what it resolved to."""
    return {"backend": backend(), "gpu": gpu_name(), "dtype": dtype, "float32": upcasts(dtype)}
