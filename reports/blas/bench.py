"""Float32 matmul throughput of MLX's CPU backend with the BLAS bundled in the `mlx[cpu]` wheel
vs Debian's OpenBLAS preloaded (what `engine.blas.reexec_with_fast_blas` does for training).

    uv run python reports/blas/bench.py

Each arm runs in its own process (LD_PRELOAD acts at process start), arms alternate, median of
the rounds. Prints a table and writes reports/blas/blas.json."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.blas import DISABLE_ENV, openblas_path  # noqa: E402

N = 1024
REPS = 5
ROUNDS = 3
WORKER = f"""
import time, mlx.core as mx
a = mx.random.normal(({N}, {N})); b = mx.random.normal(({N}, {N})); mx.eval(a, b)
mx.eval(a @ b)  # warm-up (kernel JIT, thread pools)
t = time.perf_counter()
for _ in range({REPS}):
    mx.eval(a @ b)
print(2 * {N}**3 * {REPS} / (time.perf_counter() - t) / 1e9)
"""


def gflops(preload: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env[DISABLE_ENV] = "1"
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip())


def main() -> None:
    lib = openblas_path()
    arms = {"bundled BLAS": None} | ({"OpenBLAS (LD_PRELOAD)": str(lib)} if lib else {})
    runs: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(ROUNDS):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            runs[name].append(gflops(arms[name]))
    medians = {name: statistics.median(v) for name, v in runs.items()}
    print(f"float32 {N}x{N} matmul, {REPS} reps per run, {ROUNDS} rounds, alternating arms")
    print("| arm | median GFLOPS | rounds |")
    print("|---|---|---|")
    for name, v in runs.items():
        print(f"| {name} | {medians[name]:.1f} | {' '.join(f'{x:.1f}' for x in v)} |")
    if lib:
        print(f"speed-up: {medians['OpenBLAS (LD_PRELOAD)'] / medians['bundled BLAS']:.1f}x")
    out = Path(__file__).with_name("blas.json")
    out.write_text(json.dumps({"n": N, "reps": REPS, "rounds": runs, "median_gflops": medians,
                               "openblas": str(lib) if lib else None,
                               "loadavg": os.getloadavg(),
                               "when": time.strftime("%Y-%m-%d %H:%M %Z"),
                               "command": "uv run python reports/blas/bench.py"}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
