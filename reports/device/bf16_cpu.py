"""How far MLX's CPU backend computes a quantized matmul from float64, in bfloat16 and in
float32: why the engine computes in float32 on the CPU (engine.device). One `gather_qmm` of
an int4 expert (hidden 128 -> 64, the fixtures' width, and 2048 -> 1024), scales and input in
the dtype, against the float64 dequantized product of the same quantized weights.

    uv run python reports/device/bf16_cpu.py     # prints a table, writes bf16_cpu.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from dequant_reference import dequantize  # noqa: E402  (the tests' float64 reference)


def rel_error(dtype_name: str, d_in: int, d_out: int, trials: int = 16) -> float:
    import mlx.core as mx

    dt = getattr(mx, dtype_name)
    rng = np.random.default_rng(0)
    errs = []
    for _ in range(trials):
        w = mx.array(rng.standard_normal((4, d_out, d_in)).astype(np.float32) * 0.05)
        q, s, b = mx.quantize(w.astype(dt), 64, 4)
        x = mx.array(rng.standard_normal((1, d_in)).astype(np.float32)).astype(dt)
        y = mx.gather_qmm(x[None, None], q, s, b, rhs_indices=mx.array([[2]], mx.uint32),
                          transpose=True, group_size=64, bits=4)
        y = np.array(y.astype(mx.float32), np.float64).ravel()

        def f64(a):
            return np.array(a.astype(mx.float32), np.float64)
        ref = dequantize(np.array(q), f64(s), f64(b))[2] @ f64(x).ravel()
        errs.append(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    return float(np.median(errs))


def main() -> None:
    import mlx.core as mx

    rows = [{"dtype": dt, "shape": f"{d_in}->{d_out}", "median_rel_l2": rel_error(dt, d_in, d_out)}
            for dt in ("float32", "bfloat16") for d_in, d_out in ((128, 64), (2048, 1024))]
    print(f"gather_qmm (int4, group 64) vs float64 on {mx.default_device()}, median of 16")
    print("| dtype | shape | relative L2 |\n|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['shape']} | {r['median_rel_l2']:.2e} |")
    out = Path(__file__).with_name("bf16_cpu.json")
    out.write_text(json.dumps({"command": "uv run python reports/device/bf16_cpu.py",
                               "device": str(mx.default_device()), "mlx": mx.__version__,
                               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
