"""Compute probes: time the real engine's pieces on a converted model, so the
simulator's compute and graph-building figures for this machine come from measurement.

  glu_ms[K]        engine.paths.kernel.switch_glu for one token at K experts (layer 0's experts
                   all resident), `chain` calls per mx.eval (as inside a step: one eval per
                   step, not per op); its wall time and the compute thread's CPU
                   (`glu_cpu_ms`)
  expert sizes     the same kernel on synthetic stacks of wider experts (calibration.
                   expert_size_probe): its rate against a bundle's size
  resident step    a decode step with every expert resident behind the same kernel (a path that
                   gathers from the full stack): graph-build time (model call, no eval) and
                   eval time; build / layers is the pure graph-building cost per layer
  non-MoE step     the same step with the routed experts replaced by zeros (router, attention,
                   norms, lm_head kept): the non-MoE compute per step, wall and the compute
                   thread's CPU (`non_moe_cpu_ms`)
  exact step       the default engine path (on-demand, exact) on a warm page cache: the main
                   thread's CPU per layer besides reads and router syncs (np.unique, stack
                   allocation, graph building), the router syncs, and the bundle reads; its
                   extra work over graph building is also timed alone (`exact_extra_ms`)
  cold bundles     the exact path decoding with sampled tokens (DECODE_TEMP) after each drop of
                   the expert files' pages, until COLD_READS cold loads: cold read cost inside
                   decode (their mean)
  cold read CPU    cold bundle reads through the store on one thread, the page cache dropped:
                   the thread's CPU time per read (time.thread_time: the kernel's work for the
                   requests, the pages and the copy), `cold_read_cpu_ms` (median)
  O_DIRECT bundles the store opened with O_DIRECT: every read goes to the device
  refused warm     read_bundle_if_warm on a cold bundle (None): what the main thread pays per
                   demand miss asking the page cache before it hands the reads out
  prefill          one prefill chunk through the resident path: prefill compute throughput
  thread hand-off  a no-op read request through engine.readers.ReaderPool (the engine's reader
                   threads, help_main off so a reader always does it): from the submit to the
                   reader's start (queue put, the idle reader's wake-up and claim) is
                   `reader_wake_ms`, from there to the main thread's return from `wait` (event
                   set, main-thread wake-up) `handoff_ms` (medians)
  GIL hand-over    a thread asleep on the GIL after a cold page read (as a reader thread)
                   while the main thread runs Python: from the main thread's release (it
                   enters a blocking call) to the waiter running Python again,
                   `gil_handoff_ms` (median: a wake-up across cores)
  queue ahead      the resident step again, each router's ids brought to the host as the
                   engine's fill points do: the walk up to the router handed over with
                   mx.async_eval, then waited for. async_eval returns only once few tasks are
                   in flight (MLX blocks the caller above MAX_ACTIVE_TASKS; on CPU a task is
                   one operation); the median time still left after it returned (the rest of
                   the walk, and the waiter's wake-up) is `queue_ahead_ms`, and the main
                   thread's CPU time inside async_eval (MLX prepares and dispatches each
                   operation on the calling thread) is `dispatch_ms`, per router; and each
                   layer's experts handed over the same way after their router's sync (as a
                   fill point hands its gather over): the compute left, `gather_queue_ahead_ms`

The decode configurations are loaded side by side and take turns, one step each (round robin),
so they see the same machine load. Every timing is the 10th percentile of its repeats
(calibration.profile_values.cost), except the hand-off: its median (a wake-up on a loaded machine
is part of what the main thread pays), and bundle reads: their mean (`expected`: a run pays the
sum of its reads). Numbers go to calibration.profile_values (no MLX), which
fits and writes the profiles.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from calibration import handover_probe
from calibration.bundle_views import one_row_views
from calibration.expert_size_probe import CHAIN, KS, chained_glu_ms, expert_size_curve
from calibration.fill_probe import fill_host_ms
from calibration.profile_values import ComputeResult, cost, expected, expert_rate_gbps
from calibration.zero_fill_probe import zero_fill_curve
from contract.errors import IOFault
from engine.paths.exact import ExactPath
from engine.paths.kernel import ExpertPath, alloc_stack, switch_glu
from engine.store import ExpertStore
from sim.model_profile import resident_figures
from traces.regime import DECODE_SEED, DECODE_TEMP

DEFAULT_MODEL = Path("models") / "tiny-trained-stream"
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


class ResidentPath(ExpertPath):
    """Every expert of the layer resident in one stack; the kernel gathers routed ids."""

    name = "resident"

    def __init__(self, store: ExpertStore, layer: int, sync: bool = False,
                 stacks: dict | None = None):
        exact = ExactPath(store, layer)
        self.quant = exact.quant
        stacks = {} if stacks is None else stacks  # shared between instances: one copy
        if layer not in stacks:
            stacks[layer] = exact.fetch(np.arange(store.manifest.num_experts))
        self.stack = stacks[layer]
        self.sync = sync  # bring the routed ids to the host first, as the engine's paths do

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.sync:
            t0 = time.perf_counter_ns()
            np.array(inds, copy=True)
            TimedExact.sync_ns += time.perf_counter_ns() - t0
        return switch_glu(x, self.stack, inds, self.quant)


class AsyncProbePath(ResidentPath):
    """ResidentPath whose router ids come to the host as the engine's fill points bring them:
    the walk up to the router handed over with mx.async_eval (how long it blocked), then
    waited for (the compute still left when it returned)."""

    def __init__(self, store: ExpertStore, layer: int, stacks: dict,
                 samples: list[tuple[float, float, float]]):
        super().__init__(store, layer, False, stacks)
        # (ms blocked in async_eval, ms left after it, main-thread CPU ms inside it) per router
        self.samples = samples

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if inds.size == inds.shape[-1]:  # one token (a decode step; prompts are not timed)
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            mx.async_eval(inds)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            np.array(inds, copy=True)
            t2 = time.perf_counter_ns()
            self.samples.append(((t1 - t0) / 1e6, (t2 - t1) / 1e6, (c1 - c0) / 1e6))
        return switch_glu(x, self.stack, inds, self.quant)


class GatherProbePath(ResidentPath):
    """ResidentPath whose experts are handed over as the engine's fill points hand a layer's
    gather over: the router's ids on the host first (the queue empties), then the experts
    with mx.async_eval (how long it blocked), then waited for (the compute still left when it
    returned: a few large operations, where a walk to a router leaves many small ones)."""

    def __init__(self, store: ExpertStore, layer: int, stacks: dict,
                 samples: list[tuple[float, float]]):
        super().__init__(store, layer, True, stacks)
        self.samples = samples  # (ms blocked in async_eval, ms left after it) per layer

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        out = super().__call__(x, inds)
        if inds.size == inds.shape[-1]:  # one token (a decode step; prompts are not timed)
            t0 = time.perf_counter_ns()
            mx.async_eval(out)
            t1 = time.perf_counter_ns()
            mx.eval(out)
            t2 = time.perf_counter_ns()
            self.samples.append(((t1 - t0) / 1e6, (t2 - t1) / 1e6))
        return out


class ZeroPath(ExpertPath):
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
    # per step, over the final eval: the compute thread's CPU time (the process's less the main
    # thread's), ms
    compute_cpu_ms: list[float] = field(default_factory=list)
    loads: list[dict] = field(default_factory=list)


def glu_times(converted: Path, ks: tuple[int, ...], reps: int, chain: int = CHAIN
              ) -> tuple[dict[int, float], dict[int, float]]:
    """ms per switch_glu call (1 token) at each K over layer 0's full expert stack: the wall
    time, and the compute thread's CPU time (calibration.expert_size_probe.chained_glu_ms)."""
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    layer = manifest.moe_layers[0]
    with ExpertStore(manifest) as store:
        exact = ExactPath(store, layer)
        stack = exact.fetch(np.arange(manifest.num_experts))
        hidden = int(exact.shapes["down_proj.weight"][0][0])
    rng = np.random.default_rng(0)
    ks = tuple(k for k in ks if k <= manifest.num_experts)
    times: dict[int, list[float]] = {k: [] for k in ks}
    cpu: dict[int, list[float]] = {k: [] for k in ks}
    for rep in range(reps + 2):
        for k in ks:  # K inner: load drifts hit every K alike
            wall_ms, cpu_ms = chained_glu_ms(stack, exact.quant, hidden, manifest.num_experts,
                                             k, rng, chain)
            if rep >= 2:  # first calls compile kernels
                times[k].append(wall_ms)
                cpu[k].append(cpu_ms)
    return {k: cost(v) for k, v in times.items()}, {k: cost(v) for k, v in cpu.items()}


GLU_KS = KS  # the SwiGLU's K values: its time against K gives expert_gbps


def expert_kernel_gbps(converted: Path, reps: int = 30, repeats: int = 3) -> float:
    """expert_gbps measured now, as calibrate measures it (glu_times over GLU_KS), the median
    of `repeats` measurements (a few seconds on a small model): how far this machine has
    drifted from its profile. One short measurement right after a run of captures once came
    out 35% low and 4 s later normal again."""
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    return float(np.median([expert_rate_gbps(glu_times(converted, GLU_KS, reps)[1],
                                             manifest.bundle_bytes) for _ in range(repeats)]))


def exact_extra_ms(converted: Path, reps: int = 200) -> float:
    """The exact path's main-thread work per layer beyond graph building and reads: routed ids
    to the host (already evaluated: no compute), np.unique, a fresh 9-tensor stack (allocated
    and evaluated), the remapped ids. Timed alone, many times: each repeat is short, so its
    10th percentile is the uncontended cost (a decode step has one per layer, and any of them
    may wait for a core on a loaded machine)."""
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    layer = manifest.moe_layers[0]
    rng = np.random.default_rng(4)
    with ExpertStore(manifest) as store:
        shapes = store.expert_shapes(layer)
    times = []
    for _ in range(reps + 5):
        inds = mx.array(rng.choice(manifest.num_experts, manifest.top_k, replace=False)
                        .astype(np.uint32)[None, None])
        mx.eval(inds)
        t0 = time.perf_counter_ns()
        host = np.array(inds, copy=True)
        experts, local = np.unique(host, return_inverse=True)
        alloc_stack(shapes, len(experts))
        mx.array(local.reshape(host.shape).astype(np.uint32))
        times.append((time.perf_counter_ns() - t0) / 1e6)
    return cost(times[5:])


class NoopStore:
    """Stands in for ExpertStore behind the engine's ReaderPool: a read that does nothing, so a
    request's round trip is the thread machinery alone."""

    step = 0

    def read_bundle(self, layer, expert, into, **_: Any) -> dict:
        now = time.perf_counter_ns()
        return {"started_ns": now, "finished_ns": now}

    def emit(self, row: dict) -> None:
        pass


def handoff_times(reps: int = 2000, warmup: int = 50,
                  readers: int = 2) -> tuple[list[float], list[float]]:
    """(wake, hand-off) ms per no-op read request through engine.readers.ReaderPool (help_main
    off: the main thread never does the read itself): wake from the submit (ticket + queue put)
    to the reader's start (its wake-up and claim, the readers idle as each request comes),
    hand-off from there to the main thread's return from `wait` (the event set, its wake-up)."""
    from engine.readers import ReaderPool

    pool = ReaderPool(NoopStore(), n=readers, help_main=False)
    wake, handoff = [], []
    try:
        for i in range(warmup + reps):
            t0 = time.perf_counter_ns()
            ticket = pool.submit_bundle(0, 0, None)
            pool.wait([ticket])
            t1 = time.perf_counter_ns()
            if i >= warmup:
                started = ticket.row["started_ns"]
                wake.append((started - t0) / 1e6)
                handoff.append((t1 - started) / 1e6)
    finally:
        pool.close()
    return wake, handoff


def gil_handoff_times(reps: int = 300, busy_ms: tuple[float, ...] = (0.5, 1.0),
                      nap_ms: float = 0.1, read_from: Path | None = None) -> list[float]:
    """Release-to-run ms of a thread that waits on the GIL: the main thread holds it `busy_ms`
    (pure Python) while a second thread's blocking call returns, so that thread sleeps on the
    lock; then the main thread stamps the time and enters time.sleep (which lets the GIL go),
    and the waiter's first stamp after that is its hand-over.

    The waiter's blocking call is what a reader thread's is: a read of a page of `read_from`
    (an expert file) dropped from the page cache first, so it waits on the device. It then
    sleeps on the lock on its own core, and the hand-over is a wake-up across cores, several
    times slower than for a waiter woken from a timer nap, which the kernel puts on the main
    thread's core. Without `read_from`, or where pages cannot be
    dropped, the waiter naps `nap_ms` (well under `busy_ms`, so it is on the lock by the
    release)."""
    from engine import platform
    from engine.platform import PAGE

    stamps: list[int] = []
    done = False
    fd = os.open(read_from, os.O_RDONLY) if read_from is not None \
        and platform.current().can_drop_pages else -1
    pages = max(os.fstat(fd).st_size // PAGE - 1, 1) if fd >= 0 else 0

    def waiter() -> None:
        i = 0
        while not done:
            if fd >= 0:  # a cold page, as a reader's pread waits on the device
                off = (i * 7919 % pages) * PAGE
                i += 1
                platform.current().drop_pages(fd, off, PAGE)
                os.pread(fd, PAGE, off)
            else:
                time.sleep(nap_ms / 1e3)
            stamps.append(time.perf_counter_ns())

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    releases: list[int] = []
    try:
        for i in range(reps * len(busy_ms)):
            end = time.perf_counter_ns() + int(busy_ms[i % len(busy_ms)] * 1e6)
            while time.perf_counter_ns() < end:  # Python, holding the GIL
                pass
            releases.append(time.perf_counter_ns())
            time.sleep(0.002)  # lets the GIL go; the waiter runs, then blocks again
    finally:
        done = True
        thread.join()
        if fd >= 0:
            os.close(fd)
    out = []
    for rel in releases:
        j = bisect.bisect_right(stamps, rel)
        if j < len(stamps):
            out.append((stamps[j] - rel) / 1e6)
    return out


def direct_bundle_ms(converted: Path, n: int = 48) -> float:
    """O_DIRECT bundle reads through the engine's store (every read goes to the device, the
    9 ranges each through an aligned bounce buffer); nan when O_DIRECT is refused."""
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    rng = np.random.default_rng(3)
    with ExpertStore(manifest, o_direct=True) as store:
        if not store.direct:
            return float("nan")
        layers = manifest.moe_layers
        views = one_row_views(store, layers)
        times = []
        for _ in range(n):
            layer = int(rng.choice(layers))
            row = store.read_bundle(layer, int(rng.integers(manifest.num_experts)), views[layer],
                                    emit=False)
            times.append((row["finished_ns"] - row["started_ns"]) / 1e6)
    return expected(times)


def refused_warm_ms(converted: Path, n: int = 48) -> float:
    """The main thread asking whether a cold bundle is wholly in the page cache and being told
    no (ExpertStore.read_bundle_if_warm returning None, as engine.readers does for each demand
    miss of a small bundle before it hands the reads out); nan when no page could be dropped.
    Where pages cannot be dropped (macOS), `converted` is calibration.uncached_copy's copy."""
    from engine import platform
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    rng = np.random.default_rng(4)
    with ExpertStore(manifest) as store:
        if platform.current().can_drop_pages and store.drop_until_cold() > 0:
            return float("nan")
        layers = manifest.moe_layers
        views = one_row_views(store, layers)
        times = []
        for _ in range(n):
            layer = int(rng.choice(layers))
            t0 = time.perf_counter_ns()
            row = store.read_bundle_if_warm(layer, int(rng.integers(manifest.num_experts)),
                                            views[layer])
            if row is None:
                times.append((time.perf_counter_ns() - t0) / 1e6)
    return cost(times)


def cold_read_times(converted: Path, n: int = 96) -> tuple[list[float], list[float]]:
    """(thread CPU ms, wall ms) of each cold bundle read through the engine's store, on this
    thread, after dropping the expert files' pages (where pages cannot be dropped, macOS:
    calibration.uncached_copy's copy, read by the store opened uncached, F_NOCACHE); random
    bundles, the warm repeats left out. Empty when no page could be dropped."""
    from engine import platform
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    rng = np.random.default_rng(5)
    cpu: list[float] = []
    wall: list[float] = []
    uncached = not platform.current().can_drop_pages
    with ExpertStore(manifest, o_direct=uncached) as store:
        if uncached and not store.direct:
            return [], []
        if not uncached and store.drop_until_cold() > 0:
            return [], []
        layers = manifest.moe_layers
        views = one_row_views(store, layers)
        for _ in range(n):
            layer = int(rng.choice(layers))
            c0 = time.thread_time_ns()
            row = store.read_bundle(layer, int(rng.integers(manifest.num_experts)), views[layer],
                                    emit=False)
            if row["cold"]:
                cpu.append((time.thread_time_ns() - c0) / 1e6)
                wall.append((row["finished_ns"] - row["started_ns"]) / 1e6)
    return cpu, wall


COLD_STEPS = 8  # decode steps after each drop of the expert files' pages: the cold-read sample
COLD_READS = 300  # cold bundle reads to average at least (their mean: a few slow ones weigh)
MAX_COLD_DROPS = 40


# the reads of cold_page_cpu, in bundles' pages back to back: up to 43 of tiny-trained's
# (2.6 MB, the wide model's and the paper's bundle scale), so the slope is measured across the
# sizes a profile is used for rather than extrapolated from 240 pages
PAGE_SPANS = (1, 4, 16, 43)


def cold_page_cpu(converted: Path, n: int = 48) -> list[tuple[int, float]]:
    """[(pages, thread CPU ms of a cold buffered read of that many pages)] for one bundle's
    pages and PAGE_SPANS bundles' pages: the kernel's CPU for a cold read grows with its pages
    (page allocation, page-cache insertion, the copy), which one bundle size cannot tell apart
    from the per-request part. Plain preads of the model's own layer files, at random
    page-aligned offsets, each file's pages dropped first (macOS: uncached reads, F_NOCACHE, of
    calibration.uncached_copy's copy: they skip the page cache's fill); the sizes take turns
    (every size once a round, the order reversed every other round: this machine's speed
    drifts), medians of `n` reads per size. [] when no page could be dropped."""
    import mmap

    from engine import platform
    from engine.loader import open_manifest

    manifest = open_manifest(converted, verify=False)
    files = sorted({converted / manifest.layers[i].file for i in manifest.moe_layers})
    small = max(-(-manifest.bundle_bytes // 4096) * 4096, 4096)
    rng = np.random.default_rng(11)
    p = platform.current()
    bufs = {span: mmap.mmap(-1, small * span) for span in PAGE_SPANS}  # page-aligned
    cpu: dict[int, list[float]] = {span: [] for span in PAGE_SPANS}
    try:
        for i in range(n):
            for j, span in enumerate(PAGE_SPANS if i % 2 == 0 else PAGE_SPANS[::-1]):
                f = files[(i * len(PAGE_SPANS) + j) % len(files)]
                try:
                    fd = p.open_buffered(str(f)) if p.can_drop_pages else \
                        p.open_uncached(str(f))
                except OSError:
                    return []  # uncached reads refused by this filesystem
                try:
                    if p.can_drop_pages:
                        p.drop_pages(fd)
                    room = os.fstat(fd).st_size - small * span
                    if room < 0:
                        continue  # a layer file smaller than this read
                    offset = int(rng.integers(room // 4096 + 1)) * 4096
                    c0 = time.thread_time_ns()
                    os.preadv(fd, [bufs[span]], offset)
                    cpu[span].append((time.thread_time_ns() - c0) / 1e6)
                finally:
                    os.close(fd)
    finally:
        for buf in bufs.values():
            buf.close()
    return [(small * span // 4096, float(np.median(cpu[span])))
            for span in PAGE_SPANS if cpu[span]]


class Runner:
    """One loaded model decoding greedily, one step at a time, so several configurations can
    take turns (round robin): every configuration then sees the same machine load, which
    matters for differences between them (the sync overhead) on a shared machine."""

    def __init__(self, converted: Path, *, path_factory=None, preset: str | None = None,
                 o_direct: bool = False):
        from mlx_lm.models.cache import make_prompt_cache

        from contract.engine_config import EngineConfig
        from engine.loader import load_streaming

        config = EngineConfig.from_preset(preset or "on-demand", o_direct=o_direct) \
            if preset or o_direct else None
        self.engine = load_streaming(converted, verify=False, path_factory=path_factory,
                                     config=config)
        self.model, self.tok, self.store = self.engine.model, self.engine.tokenizer, \
            self.engine.store
        self.stats = self.engine.stats
        self.rows: list[dict] = []
        self.store.on_load = self.rows.append
        self.times = StepTimes()
        self.make_cache = make_prompt_cache
        self.temperature = 0.0  # 0: greedy; > 0: the next token sampled at this temperature
        self.restart()

    def restart(self, drop: bool = False) -> None:
        """A fresh prompt (the KV cache stays short); `drop`: page cache dropped after it."""
        self.cache = self.make_cache(self.model)
        logits = self.model(mx.array(self.tok.encode(PROMPT))[None], cache=self.cache)
        self.token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(self.token)
        if drop and self.store.drop_until_cold() > 0:
            raise IOFault(f"{self.store.manifest.root}: the expert files' pages stayed in the "
                          "page cache after five drops (mapped or in flight elsewhere): no "
                          "cold read can be measured")

    def step(self, record: bool = True) -> None:
        """One decode step: the model call (graph building plus the path's main-thread work)
        net of the main thread's waits on reads and of router syncs, and the final eval."""
        self.rows.clear()
        TimedExact.sync_ns = 0
        sync0 = self.stats.route_sync_ns
        t0 = time.perf_counter_ns()
        logits = self.model(self.token.reshape(1, 1), cache=self.cache)
        t1 = time.perf_counter_ns()
        last = logits[:, -1, :]
        self.token = (mx.random.categorical(last / self.temperature) if self.temperature
                      else mx.argmax(last, axis=-1))
        c1, p1 = time.thread_time_ns(), time.process_time_ns()
        mx.eval(self.token)
        t2 = time.perf_counter_ns()
        c2, p2 = time.thread_time_ns(), time.process_time_ns()
        if not record:
            return
        wait_ns = sum(r["wait_ns"] for r in self.rows if r["waited"])
        sync_ns = TimedExact.sync_ns + self.stats.route_sync_ns - sync0
        t = self.times
        t.build_ms.append((t1 - t0 - wait_ns - sync_ns) / 1e6)
        t.eval_ms.append((t2 - t1) / 1e6)
        t.sync_ms.append(sync_ns / 1e6)
        t.read_ms.append(wait_ns / 1e6)
        t.compute_cpu_ms.append(((p2 - p1) - (c2 - c1)) / 1e6)
        t.loads.extend(dict(r) for r in self.rows)

    def primitives(self) -> int:
        """MLX primitives of the next decode step's graph (built, not evaluated: the runner
        is not stepped after this)."""
        logits = self.model(self.token.reshape(1, 1), cache=self.cache)
        return handover_probe.primitives(mx.argmax(logits[:, -1, :], axis=-1))

    def close(self) -> None:
        if self.engine is not None:
            self.store.on_load = None
            self.engine.close()
            self.engine = None


def round_robin(runners: dict[str, Runner], steps: int, warmup: int,
                restart_every: int = 32) -> None:
    for i in range(warmup + steps):
        if i and i % restart_every == 0:
            for r in runners.values():
                r.restart()
        for r in runners.values():
            r.step(record=i >= warmup)


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
    return cost(times)


def measure_compute(converted: Path, *, steps: int = 64, warmup: int = 6,
                    ks: tuple[int, ...] = GLU_KS, glu_reps: int = 30,
                    prefill_tokens: int = 128, handoff_reps: int = 2000,
                    presets: tuple[str, ...] = ("hot", "staged"),
                    cold_copy: Path | None = None, handover_rounds: int = 3,
                    handover_steps: int = handover_probe.STEPS, cold_reads: int = COLD_READS
                    ) -> tuple[ComputeResult, dict[str, Any]]:
    """ComputeResult for the simulator, plus the engine-side figures (dict) for the profile
    comments and the model profile (main-thread CPU per layer of each decode path, cold/warm
    bundle reads, prefill). Cold reads drop the expert files' pages; where a platform cannot
    (macOS) they read `cold_copy` (calibration.uncached_copy) uncached instead, and without it
    the cold figures are not measured."""
    from engine import platform
    from engine.loader import open_manifest

    t_start = time.perf_counter()
    converted = Path(converted)
    drop = platform.current().can_drop_pages
    manifest = open_manifest(converted, verify=False)
    layers = len(manifest.moe_layers)
    glu, glu_cpu = glu_times(converted, ks, glu_reps)
    stacks: dict = {}
    queue_samples: list[tuple[float, float, float]] = []
    gather_samples: list[tuple[float, float]] = []
    runners = {
        "resident": Runner(converted, path_factory=lambda s, i: ResidentPath(s, i, False, stacks)),
        "resident_synced": Runner(converted,
                                  path_factory=lambda s, i: ResidentPath(s, i, True, stacks)),
        "zero": Runner(converted, path_factory=lambda s, i: ZeroPath()),
        "exact": Runner(converted, path_factory=lambda s, i: TimedExact(s, i)),
        "async_probe": Runner(converted, path_factory=lambda s, i: AsyncProbePath(
            s, i, stacks, queue_samples)),
        "gather_probe": Runner(converted, path_factory=lambda s, i: GatherProbePath(
            s, i, stacks, gather_samples)),
    }
    for preset in presets:
        runners[preset] = Runner(converted, preset=preset)
    try:
        round_robin(runners, steps, warmup)
        prefill_ms = _prefill_ms(runners["resident"].model, runners["resident"].tok,
                                 prefill_tokens, reps=2) if prefill_tokens else 0.0
        step_primitives = runners["resident"].primitives()
        warm_exact = runners["exact"].times
        for name, r in runners.items():
            if name != "exact":
                r.close()  # their readers' reads could land after the drop
        cold_loads: list[dict] = []
        if drop or cold_copy is not None:
            if drop:
                cold_runner = runners["exact"]
                cold_runner.times = StepTimes()
            else:  # macOS: the never-cached copy, read uncached (F_NOCACHE)
                runners["exact"].close()
                cold_runner = runners["exact_uncached"] = Runner(
                    cold_copy, path_factory=lambda s, i: TimedExact(s, i), o_direct=True)
            cold_runner.temperature = DECODE_TEMP  # sampled, as decode's routing is: greedy
            mx.random.seed(DECODE_SEED)  # steps repeat their experts and read few cold
            for _ in range(MAX_COLD_DROPS):
                if sum(1 for r in cold_runner.times.loads if r["cold"]) >= cold_reads:
                    break
                cold_runner.restart(drop=drop)  # page cache dropped after a fresh prompt
                for _ in range(COLD_STEPS):
                    cold_runner.step()
            cold_loads = cold_runner.times.loads
    finally:
        for r in runners.values():
            r.close()
    direct_ms = direct_bundle_ms(converted)
    fill_curve = zero_fill_curve(converted)
    size_curve = expert_size_curve(converted)
    cold_from = converted if drop else cold_copy
    refused_ms = refused_warm_ms(cold_from) if cold_from else float("nan")
    fill_ms, fill_loads = fill_host_ms(converted)
    read_cpu, read_wall = cold_read_times(cold_from) if cold_from else ([], [])
    page_cpu = cold_page_cpu(cold_from) if cold_from else []
    exact_extra = exact_extra_ms(converted)
    wake, handoff = handoff_times(handoff_reps)
    cross = handover_probe.measure(rounds=handover_rounds, steps=handover_steps) \
        if handover_rounds else None
    first_layer = manifest.layers[manifest.moe_layers[0]]
    gil_handoff = gil_handoff_times(max(handoff_reps // 4, 20),
                                    read_from=converted / first_layer.file)
    times = {name: r.times for name, r in runners.items()}
    times["exact"] = warm_exact
    resident, synced, zero, exact = (times[n] for n in ("resident", "resident_synced", "zero",
                                                        "exact"))
    per_path = {"exact": exact, **{p: times[p] for p in presets}}

    def read_ms(rows: list[dict], want_cold: bool) -> float:
        return expected([(r["finished_ns"] - r["started_ns"]) / 1e6 for r in rows
                        if bool(r["cold"]) == want_cold and r["expert"] >= 0])

    m = cost
    unsynced = m(resident.eval_ms)
    synced_compute = m([s + e for s, e in zip(synced.sync_ms, synced.eval_ms, strict=True)])
    result = ComputeResult(
        model=str(converted),
        layers=layers,
        experts=manifest.num_experts,
        bundle_bytes=manifest.bundle_bytes,
        bundle_reads=1 if manifest.layout == "bundled"
        else len(manifest.layers[manifest.moe_layers[0]].names),
        resident_bytes=resident_figures(converted / "resident.safetensors",
                                        (manifest.resident_quantization or {}).get("bits"))[0],
        glu_ms=glu,
        glu_cpu_ms=glu_cpu,
        build_ms_per_layer=m(resident.build_ms) / layers,
        engine_build_ms_per_layer=m(resident.build_ms) / layers + exact_extra,
        non_moe_ms=m(zero.eval_ms),  # model calls only build: the eval is all the compute
        non_moe_cpu_ms=m(zero.compute_cpu_ms) if zero.compute_cpu_ms else float("nan"),
        step_ms=unsynced,
        sync_ms=(synced_compute - unsynced) / layers,
        synced_compute_ms=synced_compute,
        path_build_ms_per_layer={
            # each path per decode step, net of read waits and router syncs: the exact path's
            # fresh stack is evaluated there as in decode, handed to MLX's compute thread
            # after a router sync; the same work timed alone in a tight loop, much less on
            # both machines of reports/cross-machine, is kept as "exact_alone"
            **{p: m(t.build_ms) / layers for p, t in per_path.items()},
            "exact_alone": m(resident.build_ms) / layers + exact_extra},
        prefill_ms=prefill_ms,
        prefill_tokens=prefill_tokens,
        warm_bundle_ms=read_ms(exact.loads, False),
        cold_bundle_ms=read_ms(cold_loads, True),
        cold_bundles=sum(1 for r in cold_loads if r["cold"]),
        direct_bundle_ms=direct_ms,
        refused_warm_ms=refused_ms,
        fill_host_ms=fill_ms,
        fill_host_loads=fill_loads,
        handoff_ms=float(np.median(handoff)),
        handoff_p10_ms=cost(handoff),
        reader_wake_ms=float(np.median(wake)),
        reader_wake_p10_ms=cost(wake),
        handoff_reps=len(handoff),
        gil_handoff_ms=float(np.median(gil_handoff)),
        gil_handoff_p90_ms=float(np.percentile(gil_handoff, 90)),
        gil_handoff_reps=len(gil_handoff),
        cold_read_cpu_ms=float(np.median(read_cpu)) if read_cpu else float("nan"),
        cold_read_wall_ms=float(np.median(read_wall)) if read_wall else float("nan"),
        cold_read_reps=len(read_cpu),
        cold_page_cpu=page_cpu,
        queue_ahead_ms=float(np.median([left for _, left, _ in queue_samples])),
        async_blocked_ms=float(np.median([blocked for blocked, _, _ in queue_samples])),
        dispatch_ms=float(np.median([cpu for _, _, cpu in queue_samples])),
        queue_ahead_reps=len(queue_samples),
        gather_queue_ahead_ms=float(np.median([left for _, left in gather_samples]))
        if gather_samples else float("nan"),
        gather_queue_ahead_reps=len(gather_samples),
        zero_fill_curve=fill_curve,
        expert_size_curve=size_curve,
        primitives_per_step=step_primitives,
        cross_core_op_us=cross.wall_us if cross else float("nan"),
        cross_core_op_main_us=cross.main_cpu_us if cross else float("nan"),
        cross_core_op_cpu_us=cross.cpu_us if cross else float("nan"),
        cross_core_primitives=cross.primitives if cross else 0,
        cross_core_rounds=cross.rounds if cross else 0,
        compute_wait_ms_per_layer=float(np.median(
            [e - c for e, c in zip(resident.eval_ms, resident.compute_cpu_ms, strict=True)]
        )) / layers if resident.compute_cpu_ms else float("nan"),
    )
    engine = {name: {"build_ms": m(t.build_ms), "sync_ms": m(t.sync_ms), "read_ms": m(t.read_ms),
                     "eval_ms": m(t.eval_ms), "loads_per_step": len(t.loads) / max(steps, 1)}
              for name, t in {"resident": resident, "resident_synced": synced, "zero": zero,
                              **per_path}.items()}
    result.seconds = time.perf_counter() - t_start
    return result, engine
