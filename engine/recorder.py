"""The trace recorder: plugs into the engine's hooks and writes a trace (traces.schema) through
traces.writer.TraceWriter.

    rec = Recorder(out_dir, run_info(engine.manifest, engine_info(engine)))
    rec.attach(engine)                             # store.on_load + every block's on_routing
    engine.generate(prompt, n, **rec.hooks())
    rec.close()                                    # run.json complete=true

What each step row holds (one row per forward step, written in `on_step`, after the step's eval):
- start/end: generate's timestamps around the forward (graph build + mx.eval).
- blocked_ns: main-thread time blocked on expert loads = sum of wait_ns of the step's waited
  loads (synchronous reads in the exact path; reader-thread waits are split over the tickets
  without overlap by engine.readers, so the sum is the real blocked time).
- build_ns / eval_ns: generate's build and eval times NET of the blocked time that fell in each,
  so build_ns + eval_ns + blocked_ns = end_ns - start_ns. With the decode loop's lookahead a
  step row is a window of wall time whose build is the next step's graph (engine.generate).
  Attribution: blocked_ns is the reads (waits) alone; the wait of a load is
  [finished_ns - wait_ns, finished_ns]; the part of it inside the row's build spans comes off
  build_ns (the exact path, and any path outside the decode loop's fill points, reads while
  the graph is built: it pulls each layer's routed ids to the host, which evaluates the graph
  up to that router), the rest off eval_ns (staged and hot fills at fill points, during
  evaluation).
- bytes_read, loads, cold_loads: from the step's load rows (loads labelled with an earlier step
  that arrive late are counted in the step being written, so the totals always match the loads
  table; loads labelled with a later step wait for that step).
- cache_hits/misses/evictions: per-step differences of the paths' shared cumulative counters
  (the engine's engine.paths.stats.PathStats).
- Host syncs of routed ids that the paths count (PathStats.route_sync_ns: the time inside
  `np.array(inds)`, which evaluates the graph up to that router) are compute, not graph
  building: that time is moved from build_ns to eval_ns. A path that syncs without counting
  leaves it in build_ns.
- mlx_active_bytes: allocator active bytes after the step; mlx_peak_bytes: allocator peak
  DURING the step (the recorder resets MLX's process-wide peak at every step start);
  rss_bytes: /proc/self/statm.
- page_cache_bytes: resident bytes of the expert files (store.page_cache_bytes(), mincore over
  every file: its cost grows with the experts' bytes, so it is sampled: by default at most ~0.2%
  of wall time, i.e. a sample is taken when 500x the last sample's cost has passed; -1 on other
  steps).

Routing: the blocks hand over lazy (inds, weights) per layer; they are kept lazy during the step
and brought to the host once per step, after the step's eval (one `mx.eval` over all of them,
a no-op when the step's eval already computed them), never per layer: a per-layer host sync
costs 14-18% on the tiny model. One row per (step, layer, token), source "router".
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine import memory
from engine.device import device_info
from engine.engine import Engine
from engine.manifest import MANIFEST_FILE, Manifest, sha256_file
from traces.run_info import RunInfo, machine_info
from traces.writer import TraceWriter

COUNTERS = ("cache_hits", "cache_misses", "cache_evictions", "route_sync_ns")


def model_info(manifest: Manifest, name: str | None = None) -> dict[str, Any]:
    """run.json `model`: what the trace's routing and loads refer to."""
    cfg = manifest.config
    layers = cfg.get("num_hidden_layers") or (max(manifest.moe_layers) + 1)
    return {
        "name": name or manifest.root.resolve().name,
        "architecture": manifest.model_type,
        "layers": int(layers),
        "moe_layers": manifest.moe_layers,
        "experts": manifest.num_experts,
        "k": getattr(manifest, "native_top_k", manifest.top_k),  # the model's own K
        "bundle_bytes": manifest.bundle_bytes,
        "expert_bytes": sum(e.bundle_bytes for e in manifest.layers.values())
        * manifest.num_experts,
        "quantization": manifest.quantization,
        "manifest_sha256": sha256_file(manifest.path(MANIFEST_FILE)),
        "path": str(manifest.root.resolve()),
    }


def paths_in_use(model) -> dict[str, Any]:
    """{"decode": {path name: [layers]}, "prefill": {...}} read from the installed blocks."""
    from engine.loader import streaming_blocks

    out: dict[str, dict[str, list[int]]] = {"decode": {}, "prefill": {}}
    for layer, block in sorted(streaming_blocks(model).items()):
        decode = getattr(block.path, "name", type(block.path).__name__)
        prefill_path = block.prefill_path or block.path
        prefill = getattr(prefill_path, "name", type(prefill_path).__name__)
        out["decode"].setdefault(decode, []).append(layer)
        out["prefill"].setdefault(prefill, []).append(layer)
    return out


def engine_info(engine: Engine) -> dict[str, Any]:
    """run.json `engine`: the engine's config (`EngineConfig.to_dict()`, contract.engine_config)
    plus what is observed on the loaded model (the K it routes at, resolved buffer sizes, paths
    per phase and layer, the platform and device, effective O_DIRECT, and how the store told a
    warm load from a cold one: the trace's cold flags mean what that method measures)."""
    store = engine.store
    base = dict(engine.config.to_dict())
    base.setdefault("k", store.manifest.top_k)  # the K it routed at (EngineConfig.top_k)
    base["prerouter"] = base.get("prerouter") or False
    base["lora"] = base.get("lora") or False
    base["buffer_bytes"] = engine.runtime.buffer_bytes()  # resolved sizes (hot, staged, ...)
    base["paths_in_use"] = paths_in_use(engine.model)
    base["platform"] = store.platform.features()  # what the OS provided (engine.platform)
    base["device"] = device_info(base.get("dtype", "auto"))
    base["o_direct_effective"] = store.direct
    base["o_direct_fallback"] = store.direct_fallback
    base["residency"] = {"method": store.residency_method,
                         "fallback": store.residency_fallback,
                         "nowait_starts_io": store.nowait_starts_io}
    return base


def run_info(manifest: Manifest, engine: dict[str, Any], *, name: str | None = None,
             command: list[str] | None = None, extra: dict[str, Any] | None = None) -> RunInfo:
    run = RunInfo(model=model_info(manifest, name), engine=engine,
                  machine=machine_info(manifest.root), extra=dict(extra or {}))
    if command is not None:
        run.command = list(command)
    return run


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint, sorted union of [a, b) intervals."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _clipped(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Length of the union of `intervals` inside [lo, hi)."""
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b in _merge(intervals))


class Recorder:
    def __init__(
        self,
        directory: str | Path,
        run: RunInfo,
        *,
        flush_every: int = 32,
        flush_interval_s: float = 2.0,
        max_flush_fraction: float = 0.005,
        page_cache_every: int | None = None,
        page_cache_fraction: float = 0.002,
        reset_peak: bool = True,
    ) -> None:
        """Rows are written between requests (before a prefill step starts) once
        `flush_every` steps are held, and inside a request only past the writer's
        `max_held_steps`, then at most every `flush_interval_s` (and at most
        `max_flush_fraction` of wall time); `page_cache_every` N steps (None: adaptive, at most
        `page_cache_fraction` of wall time; 0: never)."""
        self.writer = TraceWriter(directory, run, flush_every=flush_every,
                                  min_interval_s=flush_interval_s,
                                  max_flush_fraction=max_flush_fraction)
        self.run = run
        self.store = None
        # (process, main thread, reader threads) CPU ns at the last row
        self._cpu_last: tuple[int, int, int] | None = None
        self._readers = None  # the engine's engine.readers.ReaderPool
        self.page_cache_every = page_cache_every
        self.page_cache_fraction = page_cache_fraction
        self.reset_peak = reset_peak
        self.steps = 0
        self.overhead_ns = 0  # time spent in on_step (what tracing adds between steps)
        self._loads: deque[dict] = deque()  # filled from any thread (deque appends are atomic)
        self._later: list[dict] = []  # drained loads labelled with a step not yet written
        self._routing: dict[int, list[tuple]] = {}  # step -> its blocks' lazy routing
        self._hints: dict[int, dict[int, list[int]]] = {}  # step -> {layer: hinted experts}
        self._building = -1  # the step whose graph is being built (gets on_routing calls)
        self._last_phase = ""  # of the last step recorded ("decode" before a new request)
        self._stats = None  # the engine's engine.paths.stats.PathStats
        self._last_counts: dict[str, int] = {}
        self._pc_cost_ns = 0
        self._pc_last_ns = 0
        self._blocks: list = []
        self._prev_on_load = None

    # ------------------------------------------------------------ wiring

    def attach(self, engine: Engine) -> Recorder:
        """Install the load and routing hooks on an engine (engine.loader.load_streaming)."""
        from engine.loader import streaming_blocks

        store = self.store = engine.store
        self._prev_on_load = store.on_load
        store.on_load = self.on_load if store.on_load is None else self._chained_on_load
        self._blocks = list(streaming_blocks(engine.model).values())
        for block in self._blocks:
            block.on_routing = self.on_routing
            if hasattr(block.path, "on_hint"):
                block.path.on_hint = self.on_hint
        self._stats = engine.stats
        self._readers = engine.runtime.readers
        self._last_counts = self._count()
        self._cpu_last = None
        return self

    def detach(self) -> None:
        if self.store is not None:
            self.store.on_load = self._prev_on_load
        for block in self._blocks:
            if block.on_routing == self.on_routing:
                block.on_routing = None
            if getattr(block.path, "on_hint", None) == self.on_hint:
                block.path.on_hint = None
        self._blocks = []

    def hooks(self) -> dict[str, Any]:
        """Keyword arguments for engine.generate.generate."""
        return {"on_step_start": self.on_step_start, "on_step": self.on_step}

    def _chained_on_load(self, row: dict) -> None:
        self._loads.append(row)
        self._prev_on_load(row)

    def _count(self) -> dict[str, int]:
        stats = self._stats
        return {k: int(getattr(stats, k, 0)) for k in COUNTERS} if stats is not None else {}

    # ------------------------------------------------------------ hooks

    def on_load(self, row: dict) -> None:
        self._loads.append(row)

    def on_routing(self, layer: int, inds: mx.array, weights: mx.array,
                   source: str = "router", router_inds: mx.array | None = None) -> None:
        self._routing.setdefault(self._building, []).append(
            (layer, inds, weights, source, router_inds))

    def on_hint(self, step: int, layer: int, experts: list[int]) -> None:
        """A first-layer hint started reading `experts` for `layer` of `step`."""
        self._hints.setdefault(step, {})[layer] = list(experts)

    def on_step_start(self, step: int, phase: str, tokens: int) -> None:
        if phase == "prefill" and self._last_phase != "prefill":
            self.writer.flush_if_due()  # a new request: none of its steps is timed yet
        self._building = step
        self._routing[step] = []  # a step built ahead and dropped (EOS) left its number free
        self._hints.pop(step, None)  # (and maybe a hint)
        if self.reset_peak:
            memory.reset_mlx_peak()

    def on_step(self, row: dict) -> None:
        t0 = time.perf_counter_ns()
        step = int(row["step"])
        start = int(row["start_ns"])
        row = dict(row)
        spans = row.pop("build_spans", None) or [(start, start + int(row["build_ns"]))]
        mine, later = [], []
        for r in self._later:
            (mine if r["step"] <= step else later).append(r)
        loads = self._loads
        while loads:
            r = loads.popleft()
            (mine if r["step"] is None or r["step"] <= step else later).append(r)
        self._later = later
        nbytes = cold = blocked = 0
        waits = []
        for r in mine:
            nbytes += r["bytes"]
            cold += bool(r["cold"])
            if r["waited"] and r["wait_ns"]:
                blocked += r["wait_ns"]
                waits.append((r["finished_ns"] - r["wait_ns"], r["finished_ns"]))
        in_build = 0
        if waits:  # each wait counts against graph building where it fell inside a build span
            in_build = min(sum(_clipped(waits, a, b) for a, b in spans), blocked)
        in_eval = blocked - in_build
        counts = self._count()
        last = self._last_counts
        delta = {k: v - last.get(k, 0) for k, v in counts.items()}
        self._last_counts = counts
        sync = min(delta.get("route_sync_ns", 0), max(0, int(row["build_ns"]) - in_build))
        out = {
            **row,
            "build_ns": int(row["build_ns"]) - in_build - sync,
            "eval_ns": int(row["eval_ns"]) - in_eval + sync,
            "blocked_ns": blocked,
            "bytes_read": nbytes, "loads": len(mine), "cold_loads": cold,
            "cache_hits": delta.get("cache_hits", 0),
            "cache_misses": delta.get("cache_misses", 0),
            "cache_evictions": delta.get("cache_evictions", 0),
            "mlx_active_bytes": memory.mlx_active_bytes(),
            "mlx_peak_bytes": memory.mlx_peak_bytes(),
            "rss_bytes": memory.rss_bytes(),
            "page_cache_bytes": self._page_cache(t0),
            **self._cpu(),
        }
        for r in mine:  # loads first: an interrupt (Ctrl-C) never leaves a step without them
            self.writer.add_load(r)
        self.writer.add_step(out, hold=True)
        self._last_phase = out["phase"]
        self._write_routing(step)
        self.steps += 1
        self.overhead_ns += time.perf_counter_ns() - t0

    def _cpu(self) -> dict[str, int]:
        """CPU time since the previous row: the process's (every thread), this thread's (the
        decode loop calls on_step on the main thread) and the reader threads' (-1 where their
        clocks cannot be read)."""
        readers = self._readers.cpu_ns() if self._readers is not None else -1
        cpu, main = time.process_time_ns(), time.thread_time_ns()
        last = self._cpu_last
        self._cpu_last = (cpu, main, readers)
        if last is None:
            return {"cpu_ns": -1, "main_cpu_ns": -1, "reader_cpu_ns": -1}
        return {"cpu_ns": cpu - last[0], "main_cpu_ns": main - last[1],
                "reader_cpu_ns": readers - last[2] if min(readers, last[2]) >= 0 else -1}

    # ------------------------------------------------------------ parts

    def _page_cache(self, now_ns: int) -> int:
        if self.store is None or self.page_cache_every == 0:
            return -1
        if self.page_cache_every is not None:
            due = self.steps % self.page_cache_every == 0
        else:
            due = self._pc_last_ns == 0 or \
                now_ns - self._pc_last_ns >= self._pc_cost_ns / self.page_cache_fraction
        if not due:
            return -1
        t0 = time.perf_counter_ns()
        value = self.store.page_cache_bytes()
        self._pc_last_ns = time.perf_counter_ns()
        self._pc_cost_ns = self._pc_last_ns - t0
        return value

    def _write_routing(self, step: int) -> None:
        pending = self._routing.pop(step, [])
        hints = self._hints.pop(step, {})
        for old in [s for s in self._routing if s < step]:  # steps that never finished
            del self._routing[old]
        for old in [s for s in self._hints if s < step]:
            del self._hints[old]
        if not pending:
            return
        lazy = [a for p in pending for a in (p[1], p[2], p[4]) if a is not None]
        mx.eval(lazy)  # one sync for the whole step (a no-op when the step's eval covered them)
        layers: list[int] = []
        tokens: list[int] = []
        experts: list[list[int]] = []
        weights: list[list[float]] = []
        sources: list[str] = []
        routers: list[list[int] | None] = []
        hinted: list[list[int] | None] = []
        for layer, inds, w, source, router_inds in pending:  # a plain loop: cheapest at T=1
            k = inds.shape[-1]
            e = np.asarray(inds).reshape(-1, k).tolist()
            n = len(e)
            experts.extend(e)
            weights.extend(np.asarray(w).reshape(-1, k).tolist())
            layers.extend([layer] * n)
            tokens.extend(range(n))
            sources.extend([source] * n)
            routers.extend([None] * n if router_inds is None
                           else np.asarray(router_inds).reshape(n, -1).tolist())
            hinted.extend([hints.get(layer) if n == 1 else None] + [None] * (n - 1))
        n = len(experts)
        cols = {"step": [step] * n, "layer": layers, "token": tokens, "experts": experts,
                "weights": weights, "source": sources, "router_experts": routers,
                "hinted_experts": hinted}
        self.writer.add_routing_columns(cols, n)

    # ------------------------------------------------------------ end

    def flush(self) -> None:
        self.writer.flush()

    def close(self, complete: bool = True) -> None:
        """Write what is left. complete=False (an interrupted run) keeps run.json incomplete;
        loads of a step that never finished are written too (they happened)."""
        if self.writer.closed:
            return
        while self._loads:
            self._later.append(self._loads.popleft())
        for r in self._later:
            self.writer.add_load(r)
        self._later = []
        self.run.extra.setdefault("recorder", {}).update({
            "steps": self.steps, "overhead_ms": self.overhead_ns / 1e6,
            "flushes": self.writer.flushes, "flush_ms": self.writer.flush_s * 1e3,
        })
        self.detach()
        if complete:
            self.writer.close()
        else:
            self.writer.flush()
            self.writer.closed = True

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)
