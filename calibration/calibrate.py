"""`ssdmoe calibrate`: measure this machine (storage, the engine's compute, the machine's
facts) and turn the measurements into hardware and model profile values. The one place that
uses both the engine and the simulator: calibration/ sits above both."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration.compute_probes import DEFAULT_MODEL
from calibration.profile_values import ComputeResult


def default_model(workdir: Path | None = None) -> tuple[Path, str]:
    """models/tiny-trained-stream when present, else tiny-random built and converted into a
    temporary directory (random weights: fine for timing, not for routing statistics)."""
    if (DEFAULT_MODEL / "manifest.json").is_file():
        return DEFAULT_MODEL, "models/tiny-trained-stream"
    from engine.convert import convert
    from engine.fixtures.random_models import build_tiny_random

    root = Path(workdir or tempfile.mkdtemp(prefix="ssdmoe-calibrate-"))
    src = build_tiny_random(root / "tiny-random", seed=0)
    convert(src, root / "tiny-random-stream")
    return root / "tiny-random-stream", "tiny-random (built and converted to a temp dir)"


@dataclass
class Calibration:
    model_dir: Path
    model_label: str
    storage: Any  # calibration.profile_values.StorageResult
    compute: ComputeResult
    engine: dict[str, Any]
    hardware: dict[str, tuple[Any, str]]  # Hardware key -> (value, how)
    model: dict[str, tuple[Any, str]]  # ModelProfile key -> (value, how)
    when: str
    seconds: float


# --quick: few repetitions (seconds, for tests; noisy)
QUICK_COMPUTE: dict[str, Any] = {"steps": 4, "warmup": 2, "ks": (1, 4), "glu_reps": 4,
                                 "prefill_tokens": 16, "handoff_reps": 200, "presets": (),
                                 "handover_rounds": 1, "handover_steps": 40, "cold_reads": 64}


@contextmanager
def _cold_copy(model_dir: Path, scratch: Path) -> Iterator[Path | None]:
    """Where the platform cannot drop a file's pages (macOS), a never-cached copy of the model
    in `scratch` for the cold-read probes (calibration.uncached_copy), removed afterwards;
    None where pages can be dropped."""
    from engine import platform

    if platform.current().can_drop_pages:
        yield None
        return
    from calibration.uncached_copy import uncached_copy

    root = Path(tempfile.mkdtemp(prefix=".ssdmoe-cold-", dir=scratch))
    try:
        yield uncached_copy(model_dir, root / "model")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def calibrate(model_dir: Path | None = None, scratch_dir: Path | None = None,
              quick: bool = False) -> Calibration:
    """Measure storage (scratch file in `scratch_dir`, default: next to the model) and the
    engine's compute on `model_dir` (default: models/tiny-trained-stream, else tiny-random);
    return hardware and model profile values with how each was measured."""
    from calibration.compute_probes import measure_compute
    from calibration.machine import facts
    from calibration.profile_values import hardware_values, now_text
    from calibration.storage_probes import measure_storage
    from sim.model_profile import profile_from_manifest

    t0 = time.perf_counter()
    when = now_text()
    if model_dir is None:
        model_dir, label = default_model()
    else:
        model_dir, label = Path(model_dir), str(model_dir)
    scratch = Path(scratch_dir) if scratch_dir is not None else model_dir.resolve().parent
    if quick:
        storage = measure_storage(scratch, scratch_bytes=32 << 20, per_size=4, rounds=1,
                                  threads=(1, 2))
    else:
        storage = measure_storage(scratch)
    with _cold_copy(model_dir, scratch) as cold_copy:
        compute, engine = measure_compute(model_dir, cold_copy=cold_copy,
                                          **(QUICK_COMPUTE if quick else {}))
    if (model_dir / "manifest.json").is_file():
        from calibration.queue_depth_probe import measure as measure_queue_depth

        measure_queue_depth(model_dir, scratch, rounds=1 if quick else 3,
                            depths=(1, 2) if quick else (1, 2, 3, 4, 6, 8))
    build_how = (f"measured {when}: graph building of one decode step / {compute.layers} layers, "
                 f"experts resident behind the engine's kernel (no reads, no syncs), 10th "
                 f"percentile of the steps; the engine's paths add main-thread work per layer ("
                 + ", ".join(f"{p} {v:.3f}" for p, v in compute.path_build_ms_per_layer.items())
                 + " ms, net of read waits and router syncs)")
    model = profile_from_manifest(model_dir, compute.build_ms_per_layer, build_how)
    if compute.dispatch_ms == compute.dispatch_ms:  # not nan
        model["fill_ms_per_layer"] = (round(compute.dispatch_ms, 4), (
            f"measured {when}: the main thread's CPU time inside mx.async_eval of the walk to "
            f"each router of a resident decode step (median over {compute.queue_ahead_reps} "
            "routers): MLX prepares and dispatches the operations on the calling thread; "
            "`ssdmoe validate` fits the part compute waits on inside decode, per path (notes "
            "fill_ms_per_layer.hot, fill_ms_per_layer.staged)"))
        model["dispatch_cpu_ms_per_layer"] = (round(compute.dispatch_ms, 4), (
            f"measured {when}: the same CPU time (MLX's dispatch on the calling thread), all "
            "of it: the main thread's core time per layer handed over, in either decode loop, "
            "beside the compute thread (sim.main_thread)"))
    if compute.compute_wait_ms_per_layer == compute.compute_wait_ms_per_layer:  # not nan
        model["compute_wait_ms_per_layer"] = (round(max(compute.compute_wait_ms_per_layer, 0.0),
                                                    4), (
            f"measured {when}: the evaluation of a resident decode step less the compute "
            "thread's CPU time in it (the process's less the main thread's), median over the "
            "steps, per layer: MLX's compute thread waiting for operations the main thread has "
            "not dispatched yet (sim.compute_stream)"))
    if compute.primitives_per_step:
        model["primitives_per_layer"] = (round(compute.primitives_per_step / compute.layers, 1), (
            f"measured {when}: the MLX primitives of a resident decode step's graph "
            f"({compute.primitives_per_step}, mx.export_to_dot) over its {compute.layers} "
            "layers: the operations handed to the compute thread (sim cross_core_op_us)"))
    hardware = hardware_values(storage, compute, facts(), active_params=model["active_params"][0])
    return Calibration(model_dir, label, storage, compute, engine, hardware, model, when,
                       time.perf_counter() - t0)
