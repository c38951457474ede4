"""`ssdmoe calibrate`: measure this machine (storage, the engine's compute, the machine's
facts) and turn the measurements into hardware and model profile values. The one place that
uses both the engine and the simulator: calibration/ sits above both."""

from __future__ import annotations

import tempfile
import time
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


def calibrate(model_dir: Path | None = None, scratch_dir: Path | None = None,
              quick: bool = False) -> Calibration:
    """Measure storage (scratch file in `scratch_dir`, default: next to the model) and the
    engine's compute on `model_dir` (default: models/tiny-trained-stream, else tiny-random);
    return hardware and model profile values with how each was measured."""
    from calibration.compute_probes import measure_compute
    from calibration.core_wait_probe import core_wait_how, measure_core_wait
    from calibration.idle_probe import ARMS, measure_idle_slowdown
    from calibration.machine import facts
    from calibration.profile_values import hardware_values, now_text
    from calibration.sched_probe import BURST_MS, PERIOD_MS, measure_reader_weight
    from calibration.stall_probe import measure_stall_wake
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
        compute, engine = measure_compute(model_dir, steps=4, warmup=2, ks=(1, 4), glu_reps=4,
                                          prefill_tokens=16, handoff_reps=200, presets=())
    else:
        storage = measure_storage(scratch)
        compute, engine = measure_compute(model_dir)
        curves = measure_stall_wake(model_dir)
        for loop, stall in (curves or {}).items():
            prefix = "sync_" if loop == "sync" else ""
            setattr(compute, f"{prefix}stall_points_ms", stall.stall_ms)
            setattr(compute, f"{prefix}stall_wake_main_ms", stall.main_ms)
            setattr(compute, f"{prefix}stall_wake_compute_ms", stall.compute_ms)
            if stall.busy_stall_ms:
                compute.busy_stall_points_ms = stall.busy_stall_ms
                compute.busy_stall_compute_ms = stall.busy_compute_ms
                compute.busy_stall_how = (
                    f"{', '.join(f'{d:g}' for d in stall.busy_delays_ms)} ms of warm preads "
                    f"before each expert read vs none, page cache warm, {stall.rounds} rounds "
                    "rotated, medians of paired rounds")
            compute.stall_wake_how = (
                f"{', '.join(f'{d:g}' for d in stall.delays_ms)} ms held before each expert "
                f"read vs none, page cache warm, {stall.rounds} rounds rotated, medians of "
                "paired rounds")
        weight = measure_reader_weight()
        if weight is not None:
            compute.reader_cpu_weight = weight.weight
            compute.reader_weight_how = (
                f"{weight.cores} processes waking together every {PERIOD_MS:g} ms for "
                f"{BURST_MS:g} ms of CPU beside {weight.cores} spinning ones on {weight.cores} "
                f"cores, {weight.rounds} rounds: median burst rate {weight.rate:.4f} of a core "
                f"({weight.alone_rate:.4f} without the spinners, {weight.bursts} bursts); "
                "weighted sharing gives a burst w / (w + 1), so w = r / (1 - r), at most 1000; "
                "plain sharing would give 1/2")
        wait = measure_core_wait(model_dir, scratch)
        if wait is not None:
            compute.core_wait_ms = wait.wait_ms
            compute.core_wait_how = core_wait_how(wait)
        idle = measure_idle_slowdown(model_dir)
        for loop, found in (idle or {}).items():
            prefix = "sync_" if loop == "sync" else ""
            setattr(compute, f"{prefix}idle_util_points", found.util)
            setattr(compute, f"{prefix}idle_slowdown", found.slowdown)
            compute.idle_points[loop] = found.points
            compute.idle_how = (
                "sleeps of " + ", ".join(f"{s:g} ms every {n} steps" for s, n in ARMS if n)
                + f" vs none, page cache warm, {found.rounds} rounds rotated")
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
    hardware = hardware_values(storage, compute, facts(), active_params=model["active_params"][0])
    return Calibration(model_dir, label, storage, compute, engine, hardware, model, when,
                       time.perf_counter() - t0)
