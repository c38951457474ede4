"""Calibration, the engine's side: time the real engine's pieces on a converted model, so the
simulator's compute and graph-building figures for this machine come from measurement.

  glu_ms[K]        engine.paths.kernel.switch_glu for one token at K experts (layer 0's experts
                   all resident), `chain` calls per mx.eval (as inside a step: one eval per
                   step, not per op), median per call
  resident step    a decode step with every expert resident behind the same kernel (a path that
                   gathers from the full stack): graph-build time (model call, no eval) and
                   eval time; build / layers is the pure graph-building cost per layer
  non-MoE step     the same step with the routed experts replaced by zeros (router, attention,
                   norms, lm_head kept): the non-MoE compute per step
  exact step       the default engine path (on-demand, exact) on a warm page cache: the main
                   thread's CPU per layer besides reads and router syncs (np.unique, stack
                   allocation, graph building), the router syncs, and the bundle reads
  cold bundles     the exact path right after dropping the expert files' pages: cold read cost
                   through the engine's store, to check the storage fit
  prefill          one prefill chunk through the resident path: prefill compute throughput

Numbers go to sim.calibrate (no MLX), which fits and writes the profiles.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.paths.exact import ExactPath
from engine.paths.kernel import switch_glu
from engine.store import ExpertStore
from sim.calibrate import ComputeResult

DEFAULT_MODEL = Path("models") / "tiny-trained-stream"
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


class ResidentPath:
    """Every expert of the layer resident in one stack; the kernel gathers routed ids."""

    name = "resident"

    def __init__(self, store: ExpertStore, layer: int, sync: bool = False):
        exact = ExactPath(store, layer)
        self.quant = exact.quant
        self.stack = exact.fetch(np.arange(store.manifest.num_experts))
        self.sync = sync  # bring the routed ids to the host first, as the engine's paths do

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.sync:
            t0 = time.perf_counter_ns()
            np.array(inds, copy=True)
            TimedExact.sync_ns += time.perf_counter_ns() - t0
        return switch_glu(x, self.stack, inds, self.quant)


class ZeroPath:
    """No routed experts: zeros of the kernel's output shape (the router still runs, since
    the block weights these zeros by its routing weights)."""

    name = "zero"

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        return mx.zeros((*inds.shape, x.shape[-1]), dtype=x.dtype)


class TimedExact(ExactPath):
    """The exact path with its router sync timed apart from the rest of its main-thread work."""

    sync_ns = 0

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        t0 = time.perf_counter_ns()
        host = np.array(inds, copy=True)
        TimedExact.sync_ns += time.perf_counter_ns() - t0
        experts, local = np.unique(host, return_inverse=True)
        stack = self.fetch(experts)
        local_inds = mx.array(local.reshape(host.shape).astype(np.uint32))
        return switch_glu(x, stack, local_inds, self.quant)


@dataclass
class StepTimes:
    build_ms: list[float] = field(default_factory=list)
    eval_ms: list[float] = field(default_factory=list)
    sync_ms: list[float] = field(default_factory=list)
    read_ms: list[float] = field(default_factory=list)  # per step, sum of load wait
    loads: list[dict] = field(default_factory=list)


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def glu_times(converted: Path, ks: tuple[int, ...], reps: int, chain: int = 8) -> dict[int, float]:
    """ms per switch_glu call (1 token) at each K over layer 0's full expert stack."""
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    layer = manifest.moe_layers[0]
    with ExpertStore(manifest) as store:
        exact = ExactPath(store, layer)
        stack = exact.fetch(np.arange(manifest.num_experts))
        hidden = int(exact.shapes["down_proj.weight"][0][0])
    rng = np.random.default_rng(0)
    out: dict[int, float] = {}
    for k in ks:
        if k > manifest.num_experts:
            continue
        times = []
        for rep in range(reps + 2):
            x = mx.array(rng.standard_normal((1, 1, hidden)).astype(np.float32))
            mx.eval(x)
            inds = [mx.array(rng.choice(manifest.num_experts, k, replace=False)
                             .astype(np.uint32)[None, None]) for _ in range(chain)]
            mx.eval(inds)
            t0 = time.perf_counter()
            y = x
            for i in range(chain):  # each call's input depends on the last: one eval, in order
                y = switch_glu(y, stack, inds[i], exact.quant).sum(axis=-2) * 0.1
            mx.eval(y)
            if rep >= 2:  # first calls compile kernels
                times.append((time.perf_counter() - t0) * 1e3 / chain)
        out[k] = _median(times)
    return out


def _decode_steps(model, tokenizer, steps: int, warmup: int, store=None,
                  drop_after_prefill: bool = False) -> StepTimes:
    """Greedy decode after a short prompt; per measured step: the model call (graph building,
    plus the path's main-thread work) net of the main thread's waits on reads and of router
    syncs (TimedExact's, or the paths' PathStats), and the final eval."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = tokenizer.encode(PROMPT)
    cache = make_prompt_cache(model)
    logits = model(mx.array(ids)[None], cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(token)
    out = StepTimes()
    rows: list[dict] = []
    stats = getattr(store, "path_stats", None)
    if store is not None:
        if drop_after_prefill:
            store.drop_page_cache()
        store.on_load = rows.append
    for i in range(warmup + steps):
        rows.clear()
        TimedExact.sync_ns = 0
        sync0 = stats.route_sync_ns if stats is not None else 0
        t0 = time.perf_counter_ns()
        logits = model(token.reshape(1, 1), cache=cache)
        t1 = time.perf_counter_ns()
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
        t2 = time.perf_counter_ns()
        if i < warmup:
            continue
        wait_ns = sum(r["wait_ns"] for r in rows if r["waited"])
        sync_ns = TimedExact.sync_ns + ((stats.route_sync_ns - sync0) if stats else 0)
        out.build_ms.append((t1 - t0 - wait_ns - sync_ns) / 1e6)
        out.eval_ms.append((t2 - t1) / 1e6)
        out.sync_ms.append(sync_ns / 1e6)
        out.read_ms.append(wait_ns / 1e6)
        out.loads.extend(dict(r) for r in rows)
    if store is not None:
        store.on_load = None
    return out


def _prefill_ms(model, tokenizer, tokens: int, reps: int) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    ids = (tokenizer.encode(PROMPT * 40) * 4)[:tokens]
    times = []
    for rep in range(reps + 1):
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        mx.eval(model(mx.array(ids)[None], cache=cache))
        if rep:
            times.append((time.perf_counter() - t0) * 1e3)
    return _median(times)


def _run(converted: Path, steps: int, warmup: int, *, path_factory=None, preset: str | None = None,
         cold: bool = False, prefill_tokens: int = 0) -> tuple[StepTimes, StepTimes | None, float]:
    """Load the model with a path factory or an engine preset, decode; optionally a few cold
    steps (page cache dropped after the prompt) and a prefill timing."""
    from engine.config import EngineConfig
    from engine.loader import load_streaming

    config = EngineConfig.from_preset(preset) if preset else None
    model, tok, store = load_streaming(converted, verify=False, path_factory=path_factory,
                                       config=config)
    try:
        warm = _decode_steps(model, tok, steps, warmup, store=store)
        cold_steps = _decode_steps(model, tok, 2, 0, store=store, drop_after_prefill=True) \
            if cold else None
        prefill = _prefill_ms(model, tok, prefill_tokens, reps=2) if prefill_tokens else 0.0
    finally:
        store.close()
    return warm, cold_steps, prefill


def measure_compute(converted: Path, *, steps: int = 24, warmup: int = 6,
                    ks: tuple[int, ...] = (1, 2, 4, 8), glu_reps: int = 30,
                    prefill_tokens: int = 128,
                    presets: tuple[str, ...] = ("hot", "staged")) -> tuple[ComputeResult,
                                                                      dict[str, Any]]:
    """ComputeResult for the simulator, plus the engine-side figures (dict) for the profile
    comments and the model profile (main-thread CPU per layer of each decode path, cold/warm
    bundle reads, prefill)."""
    from engine.loader import open_manifest

    t_start = time.perf_counter()
    converted = Path(converted)
    manifest = open_manifest(converted, verify=False)
    layers = len(manifest.moe_layers)
    glu = glu_times(converted, ks, glu_reps)
    resident, _, prefill_ms = _run(converted, steps, warmup,
                                   path_factory=lambda s, i: ResidentPath(s, i),
                                   prefill_tokens=prefill_tokens)
    synced, _, _ = _run(converted, steps, warmup,
                        path_factory=lambda s, i: ResidentPath(s, i, sync=True))
    zero, _, _ = _run(converted, steps, warmup, path_factory=lambda s, i: ZeroPath())
    exact, cold, _ = _run(converted, steps, warmup, path_factory=lambda s, i: TimedExact(s, i),
                          cold=True)
    per_path = {"exact": exact}
    for preset in presets:
        per_path[preset], _, _ = _run(converted, steps, warmup, preset=preset)

    def read_ms(rows: list[dict], want_cold: bool) -> float:
        return _median([(r["finished_ns"] - r["started_ns"]) / 1e6 for r in rows
                        if bool(r["cold"]) == want_cold and r["expert"] >= 0])

    m = _median
    unsynced = m(resident.eval_ms)
    synced_compute = m([s + e for s, e in zip(synced.sync_ms, synced.eval_ms, strict=True)])
    result = ComputeResult(
        model=str(converted),
        layers=layers,
        experts=manifest.num_experts,
        bundle_bytes=manifest.bundle_bytes,
        resident_bytes=manifest.files["resident.safetensors"].size,
        glu_ms=glu,
        build_ms_per_layer=m(resident.build_ms) / layers,
        engine_build_ms_per_layer=m(exact.build_ms) / layers,
        non_moe_ms=m(zero.eval_ms),  # model calls only build: the eval is all the compute
        step_ms=unsynced,
        sync_ms=(synced_compute - unsynced) / layers,
        synced_compute_ms=synced_compute,
        path_build_ms_per_layer={p: m(t.build_ms) / layers for p, t in per_path.items()},
        prefill_ms=prefill_ms,
        prefill_tokens=prefill_tokens,
        warm_bundle_ms=read_ms(exact.loads, False),
        cold_bundle_ms=read_ms(cold.loads, True) if cold else float("nan"),
        cold_bundles=sum(1 for r in cold.loads if r["cold"]) if cold else 0,
    )
    engine = {name: {"build_ms": m(t.build_ms), "sync_ms": m(t.sync_ms), "read_ms": m(t.read_ms),
                     "eval_ms": m(t.eval_ms), "loads_per_step": len(t.loads) / max(steps, 1)}
              for name, t in {"resident": resident, "resident_synced": synced, "zero": zero,
                              **per_path}.items()}
    result.seconds = time.perf_counter() - t_start
    return result, engine


def default_model(workdir: Path | None = None) -> tuple[Path, str]:
    """models/tiny-trained-stream when present, else tiny-random built and converted into a
    temporary directory (random weights: fine for timing, not for routing statistics)."""
    if (DEFAULT_MODEL / "manifest.json").is_file():
        return DEFAULT_MODEL, "models/tiny-trained-stream"
    from engine.fixtures.random_models import build_tiny_random
    from engine.layout import convert

    root = Path(workdir or tempfile.mkdtemp(prefix="ssdmoe-calibrate-"))
    src = build_tiny_random(root / "tiny-random", seed=0)
    convert(src, root / "tiny-random-stream")
    return root / "tiny-random-stream", "tiny-random (built and converted to a temp dir)"
