"""How fast the quantized expert kernel runs against a bundle's size (sim keys
expert_size_bytes, expert_size_gbps).

expert_gbps is the kernel's rate on the calibration model's own bundles. A model with wider
experts streams more bytes per call: once a call's weights outgrow the CPU's caches the kernel
runs at memory's speed, not cache's, so one rate cannot serve both (measured here: tiny-trained's
61 KB bundles and tiny-trained-wide's 2.6 MB ones differ by about 5%). This probe times the same
kernel (engine.paths.kernel.switch_glu) on synthetic stacks shaped like the calibration model's
experts with the intermediate size scaled by WIDTHS: same hidden size, quantization and expert
count, random weights (the kernel's time does not depend on the values). At each width the
rate is a bundle's bytes over the per-expert slope of the time against K, as for expert_gbps;
the widths take turns inside each repeat, so the machine's drift hits them alike."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from calibration.profile_values import cost

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # intermediate sizes, as multiples of the model's
KS = (1, 2, 4, 8)  # the SwiGLU's K values: its time against K gives the per-expert slope
CHAIN = 8  # calls per mx.eval, each on the last one's output (as inside a step)
BUDGET_BYTES = 60e6  # expert bytes streamed per width and measurement, about: sets the calls
REPEATS = 3  # measurements per width, interleaved; medians


def scaled_shapes(shapes: dict[str, tuple[tuple[int, ...], str]], width: int, new_width: int
                  ) -> dict[str, tuple[tuple[int, ...], str]]:
    """An expert's tensor shapes with its intermediate size `width` made `new_width`: gate and
    up project to it (their first dimension), down projects from it (its last dimension,
    packed or grouped in proportion)."""
    out = {}
    for name, (shape, dtype) in shapes.items():
        dims = list(shape)
        axis = -1 if name.startswith("down_proj") else 0
        if dims[axis] * new_width % width:
            raise ValueError(f"{name}: dimension {dims[axis]} does not scale from intermediate "
                             f"size {width} to {new_width}")
        dims[axis] = dims[axis] * new_width // width
        out[name] = (tuple(dims), dtype)
    return out


def bundle_bytes(shapes: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """One expert's bytes over its tensors."""
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in shapes.values())


def synthetic_stack(shapes: dict[str, tuple[tuple[int, ...], str]], rows: int,
                    rng: np.random.Generator) -> dict[str, mx.array]:
    """A layer's stacked expert tensors with `rows` experts: random packed weights, small
    scales, zero biases (evaluated)."""
    stack = {}
    for name, (shape, dtype) in shapes.items():
        if name.endswith(".weight"):
            data = rng.integers(0, 2**32, size=(rows, *shape), dtype=np.uint64).astype(dtype)
        elif name.endswith(".scales"):
            data = np.full((rows, *shape), 0.01, dtype=dtype)
        else:
            data = np.zeros((rows, *shape), dtype=dtype)
        stack[name] = mx.array(data)
    mx.eval(list(stack.values()))
    return stack


def chained_glu_ms(stack: dict[str, mx.array], quant, hidden: int, rows: int, k: int,
                   rng: np.random.Generator, chain: int = CHAIN) -> tuple[float, float]:
    """(wall ms, compute-thread CPU ms) per switch_glu call (1 token, K random experts of
    `rows`), `chain` calls per mx.eval, each on the last one's output: the compute thread's
    CPU is the process's less the main thread's (its wall less the waits for the dispatch)."""
    from engine.paths.kernel import switch_glu

    x = mx.array(rng.standard_normal((1, 1, hidden)).astype(np.float32))
    inds = [mx.array(rng.choice(rows, k, replace=False).astype(np.uint32)[None, None])
            for _ in range(chain)]
    mx.eval(x, inds)
    t0, p0, c0 = time.perf_counter(), time.process_time(), time.thread_time()
    y = x
    for i in range(chain):
        y = switch_glu(y, stack, inds[i], quant).sum(axis=-2) * 0.1
    mx.eval(y)
    t1, p1, c1 = time.perf_counter(), time.process_time(), time.thread_time()
    return (t1 - t0) * 1e3 / chain, ((p1 - p0) - (c1 - c0)) * 1e3 / chain


def expert_size_curve(converted: Path, widths: tuple[int, ...] = WIDTHS, repeats: int = REPEATS
                      ) -> list[tuple[int, dict[int, float]]]:
    """(bundle bytes, {K: compute-thread CPU ms per call}) at each width, the first the
    calibration model's own: per K the median over `repeats` measurements of the 10th
    percentile of its calls (calibration.profile_values.cost), the first two rounds of each
    left out (they compile the kernels)."""
    from engine.loader import open_manifest
    from engine.paths.kernel import Quant
    from engine.store import ExpertStore

    manifest = open_manifest(converted, verify=False)
    with ExpertStore(manifest) as store:
        shapes = store.expert_shapes(manifest.moe_layers[0])
    width = shapes["gate_proj.weight"][0][0]
    hidden = shapes["down_proj.weight"][0][0]
    quant = Quant.of(manifest)
    rows = manifest.num_experts
    ks = tuple(k for k in KS if k <= rows)
    rng = np.random.default_rng(7)
    arms = []
    for w in widths:
        sh = scaled_shapes(shapes, width, width * w)
        size = bundle_bytes(sh)
        reps = int(np.clip(BUDGET_BYTES / (CHAIN * sum(ks) * size), 4, 30))
        arms.append((size, reps, synthetic_stack(sh, rows, rng), {k: [] for k in ks}))
    for _ in range(repeats):
        measured = [{k: [] for k in ks} for _ in arms]
        for rep in range(max(r for _, r, _, _ in arms) + 2):
            for (_, reps, stack, _), times in zip(arms, measured, strict=True):
                if rep >= reps + 2:  # widths inner: the machine's drift hits all alike
                    continue
                for k in ks:
                    cpu = chained_glu_ms(stack, quant, hidden, rows, k, rng)[1]
                    if rep >= 2:
                        times[k].append(cpu)
        for (_, _, _, costs), times in zip(arms, measured, strict=True):
            for k in ks:
                costs[k].append(cost(times[k]))
    return [(size, {k: float(np.median(v)) for k, v in costs.items()})
            for size, _, _, costs in arms]
