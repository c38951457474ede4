"""Calibration values, the simulator's side (no MLX, no I/O): turn measurements into
hardware-profile values with small closed-form fits, and write the profile TOML with every
value commented with how it was measured and when.

The measuring is calibration/: storage_probes (real reads, a `StorageResult`), compute_probes
(the real engine's pieces, a `ComputeResult`) and machine (RAM, cores). `hardware_values` /
`compute_values` here turn them into profile values; a read's timing is `expected`, the mean
of its repeats, every other timing `cost`, the 10th percentile of its repeats (the hand-off:
its median).

Storage (a scratch file next to the model, dropped from the page cache with
fdatasync + POSIX_FADV_DONTNEED before every cold batch):
  cold(size)   buffered pread at random offsets, POSIX_FADV_RANDOM (no readahead: what the
               engine's ExpertStore does), every page cold; `expected` (mean) per size
  warm(size)   the same range read again (page-cache hit): the copy cost
  direct_4k    O_DIRECT 4 KiB random reads, QD1: the device's per-request latency
  direct_seq   O_DIRECT sequential 4 MiB reads of the whole file: the device's transfer rate
  queue(n)     n threads each doing O_DIRECT random 1 MiB reads: aggregate throughput

How the sim's load model (sim.loads) is fitted, per bundle load of `ranges` reads (the bundled
layout reads a bundle as one range, the stacked one as 9, one per tensor):
  warm(s) = a_w + s / memcpy                      -> memcpy_gbps; load_overhead = ranges x a_w
  cold(s) = a_c + s / cold_rate                   -> ssd_bandwidth_gbps from 1/cold_rate - 1/memcpy
  ssd_latency_ms = direct_4k; cold_overhead = ranges x (a_c - a_w) - latency (the other
  ranges' device round trips and the page-fault work of a cold read, on the reading thread)
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from calibration.handover_probe import PIECES
from calibration.zero_fill_probe import REPS, STACK_MIB, TIMED
from sim.profile_toml import toml_text
from sim.scenario import HARDWARE_KEYS

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB)
BUNDLE_RANGES = 9  # {gate,up,down} x {weight,scales,biases}: reads per bundle in the engine
COST_QUANTILE = 0.1


def cost(values: list[float]) -> float:
    """The cost of a repeated computation: its 10th percentile, i.e. what it costs when this
    process is not competing for the cores (a shared 2-core machine: medians move with other
    processes' load, low quantiles much less). NaN when there is nothing to measure."""
    values = [v for v in values if v == v]
    return float(np.quantile(values, COST_QUANTILE)) if values else float("nan")


def expected(values: list[float]) -> float:
    """The cost of a repeated read: its mean. A run pays the sum of its reads, and a read's
    time varies with the device and the memory system (flash, the host's I/O path, DRAM) more
    than with other processes: a low quantile charges every read the luckiest one's time (a
    cold 2.5 MiB read's 10th percentile is 10-20% below its mean on this project's VMs, and
    decode's reads of that size paid the mean). NaN when there is nothing to measure."""
    values = [v for v in values if v == v]
    return float(np.mean(values)) if values else float("nan")


# ---------------------------------------------------------------------------------- storage

DROP_PAGES = (4, 256)  # the two range sizes of storage_probes.page_drop_times, in pages


@dataclass
class StorageResult:
    sizes: list[int]
    cold_ms: list[float]  # expected (mean) time per size
    warm_ms: list[float]
    direct_4k_ms: float
    direct_seq_gbps: float
    queue_gbps: dict[int, float]  # threads -> aggregate GB/s (O_DIRECT random 1 MiB)
    scratch: str
    scratch_bytes: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    page_drop_us: tuple[float, float] | None = None  # storage_probes.page_drop_times (None:
    # not measured, a platform that cannot drop pages)
    flush_bytes: int = 0  # written before each batch of warm reads (0: not recorded)
    # calibration.reclaim_probe: (pages of the larger read, the reading thread's CPU ms it took
    # more at a memory group's limit, the kernel's reclaimed / read pages, the wall ms it took
    # longer); None: not measured (`notes`)
    reclaim: tuple[int, float, float, float] | None = None


# ---------------------------------------------------------------------------------- fits


def linear_fit(x: list[float], y: list[float], relative: bool = True) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x; `relative` weights each point by 1/y
    (relative error), so small reads pin the intercept and big ones do not swamp it."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(xs) < 2:
        return float(ys.mean()), 0.0
    w = 1.0 / np.maximum(np.abs(ys), 1e-12) if relative else np.ones_like(ys)
    b, a = np.polyfit(xs, ys, 1, w=w)
    return float(a), float(b)


@dataclass
class ComputeResult:
    """What calibration/compute_probes.py measures with the real engine (all ms, `cost` of
    repeats)."""
    model: str  # converted model directory measured
    layers: int
    experts: int
    bundle_bytes: int
    resident_bytes: int
    glu_ms: dict[int, float]  # K -> quantized SwiGLU of one token at K experts, one layer
    build_ms_per_layer: float  # lazy graph of one decode step (experts resident) / layers
    engine_build_ms_per_layer: float  # the exact (on-demand) path's main-thread CPU per layer,
    # its extra work timed alone (path_build_ms_per_layer "exact_alone"; the scenario starts
    # from the per-step "exact")
    non_moe_ms: float  # one decode step's compute with the routed experts removed
    step_ms: float  # one full decode step's compute, experts resident, one eval per step
    # the compute thread's CPU in the two above (the process's less the main thread's; empty /
    # nan: not measured): the wall less the compute thread's waits for the main thread's
    # dispatch, which the sim charges apart (compute_wait_ms_per_layer)
    glu_cpu_ms: dict[int, float] = field(default_factory=dict)
    non_moe_cpu_ms: float = float("nan")
    sync_ms: float = 0.0  # extra compute time per router host sync (one per layer)
    synced_compute_ms: float = 0.0  # the step's compute with a host sync at every router
    path_build_ms_per_layer: dict[str, float] = field(default_factory=dict)  # engine path ->
    # main-thread CPU per layer, net of waits on reads and router syncs
    prefill_ms: float = 0.0  # one prefill chunk of prefill_tokens, experts resident
    prefill_tokens: int = 0
    warm_bundle_ms: float = 0.0  # one bundle read through the engine's store, page cache warm
    cold_bundle_ms: float = 0.0  # the same right after dropping the expert files' pages
    cold_bundles: int = 0
    direct_bundle_ms: float = float("nan")  # one bundle read with O_DIRECT (nan: refused)
    refused_warm_ms: float = float("nan")  # read_bundle_if_warm on a cold bundle (nan: none)
    fill_host_ms: float = float("nan")  # a staged fill's main-thread CPU per load (nan: none)
    fill_host_loads: int = 0
    handoff_ms: float = float("nan")  # median of a no-op read request through the engine's
    # reader threads, from the reader's start to the main thread's return (nan: not measured)
    handoff_p10_ms: float = float("nan")
    reader_wake_ms: float = float("nan")  # the same requests, from the submit to the idle
    # reader's start (nan: not measured)
    reader_wake_p10_ms: float = float("nan")
    handoff_reps: int = 0
    gil_handoff_ms: float = float("nan")  # median release-to-run of a thread asleep on the GIL
    gil_handoff_p90_ms: float = float("nan")  # (nan: not measured)
    gil_handoff_reps: int = 0
    cold_read_cpu_ms: float = float("nan")  # median thread CPU of a cold bundle read (nan: not
    # measured)
    cold_read_wall_ms: float = float("nan")  # the same reads' median wall time
    cold_read_reps: int = 0
    # calibration.compute_probes.cold_page_cpu: (pages, CPU ms of a cold read of that many),
    # one bundle's pages first (empty: not measured)
    cold_page_cpu: list[tuple[int, float]] = field(default_factory=list)
    queue_ahead_ms: float = float("nan")  # median compute left when mx.async_eval of the
    # walk to a router returned (nan: not measured)
    async_blocked_ms: float = float("nan")  # median time that async_eval blocked
    dispatch_ms: float = float("nan")  # median main-thread CPU inside that async_eval: MLX
    # prepares and dispatches a layer's operations on the calling thread (nan: not measured)
    queue_ahead_reps: int = 0  # routers timed
    gather_queue_ahead_ms: float = float("nan")  # median compute left when mx.async_eval of
    # a layer's experts returned, after their router's sync (nan: not measured)
    gather_queue_ahead_reps: int = 0  # layers timed
    # calibration.zero_fill_probe: (rotation MiB, alloc_stack's ms per MiB filled), the
    # rotation ascending (empty: not measured)
    zero_fill_curve: list[tuple[float, float]] = field(default_factory=list)
    # calibration.expert_size_probe: (bundle bytes, {K: the compute thread's CPU ms per
    # call}), the bundle ascending (empty: not measured)
    expert_size_curve: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    primitives_per_step: int = 0  # MLX primitives of a resident decode step's graph (0: not
    # counted)
    # calibration.handover_probe: per primitive, the wall time and the main thread's CPU a step
    # takes more with the threads on every core than pinned to one (nan: not measured)
    cross_core_op_us: float = float("nan")
    cross_core_op_main_us: float = float("nan")
    # ... and the process's CPU (every thread): less the main thread's, the compute thread's
    # saving on one core (raw measurements only, no profile key yet)
    cross_core_op_cpu_us: float = float("nan")
    # median over resident decode steps' final eval of its wall less the compute thread's CPU
    # (the process's less the main thread's), per layer
    compute_wait_ms_per_layer: float = float("nan")
    cross_core_primitives: int = 0  # the probe's primitives a step
    cross_core_rounds: int = 0  # its rounds (each arm once a round)
    bundle_reads: int = BUNDLE_RANGES  # the measured model's preads per bundle (one per tensor
    # slice of its first MoE layer)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def page_slope_us(points: list[tuple[int, float]]) -> float:
    """The per-page slope (microseconds) of calibration.compute_probes.cold_page_cpu's
    (pages, CPU ms) medians: the least-squares line through them; nan when fewer than two
    sizes were measured or it came out negative (noise)."""
    points = [(pages, ms) for pages, ms in points if ms == ms]
    if len({pages for pages, _ in points}) < 2:
        return float("nan")
    slope = float(np.polyfit([pages for pages, _ in points], [ms for _, ms in points], 1)[0])
    return slope * 1e3 if slope > 0 else float("nan")


def storage_values(st: StorageResult, c: ComputeResult | None = None,
                   ranges: int = BUNDLE_RANGES) -> dict[str, tuple[Any, str]]:
    """Hardware keys (storage part) -> (value, how it was derived). With engine bundle reads
    (`c`), the per-load CPU terms are set so the sim's cold and warm load of that bundle equal
    the measured ones; otherwise they come from the per-size fits x `ranges`."""
    sizes_mib = [s / MIB for s in st.sizes]
    a_w, b_w = linear_fit(sizes_mib, st.warm_ms)
    a_c, b_c = linear_fit(sizes_mib, st.cold_ms)
    memcpy = MIB / (b_w / 1e3) / 1e9 if b_w > 0 else 0.0
    dev_ms_per_mib = b_c - b_w
    cold_rate = MIB / (dev_ms_per_mib / 1e3) / 1e9 if dev_ms_per_mib > 0 else None
    seq = st.direct_seq_gbps if st.direct_seq_gbps > 0 else None
    bandwidth = cold_rate or seq or 1.0
    latency = st.direct_4k_ms if st.direct_4k_ms >= 0 else max(a_c - a_w, 0.0)
    qd_best = max(st.queue_gbps.values()) if st.queue_gbps else 0.0
    qd = min((n for n, g in st.queue_gbps.items() if g >= 0.9 * qd_best), default=1)
    fmt_sizes = ", ".join(_size(s) for s in st.sizes)
    cold_txt = ", ".join(f"{v:.3f}" for v in st.cold_ms)
    warm_txt = ", ".join(f"{v:.3f}" for v in st.warm_ms)
    queue_txt = ", ".join(f"{n}: {g:.2f}" for n, g in sorted(st.queue_gbps.items()))
    fit_load = ranges * max(a_w, 0.0)
    fit_cold = max(ranges * (a_c - a_w) - latency, 0.0)
    if c is not None and c.warm_bundle_ms > 0 and c.cold_bundle_ms > 0:
        b = c.bundle_bytes
        copy_ms = b / (memcpy * 1e9) * 1e3 if memcpy else 0.0
        dev_ms = ranges * latency + b / (bandwidth * 1e9) * 1e3  # one request per range
        load = max(c.warm_bundle_ms - copy_ms, 0.0)
        cold = max(c.cold_bundle_ms - c.warm_bundle_ms - dev_ms, 0.0)
        load_how = (f"engine store, warm bundle read of {c.model} ({b} bytes, {ranges} ranges): "
                    f"{c.warm_bundle_ms:.3f} ms (mean), minus its copy at memcpy_gbps "
                    f"({copy_ms:.3f} ms); the per-size fit x {ranges} ranges gives "
                    f"{fit_load:.3f} ms")
        cold_how = (f"engine store, cold bundle read ({c.cold_bundles} reads after dropping the "
                    f"files' pages): {c.cold_bundle_ms:.3f} ms (mean), minus the warm "
                    f"read and the device time {ranges} x latency + bytes/bandwidth "
                    f"({dev_ms:.3f} ms: one request per range, no readahead): the page-cache "
                    f"fill and fault work; the per-size fit gives {fit_cold:.3f} ms")
    else:
        load, cold = fit_load, fit_cold
        load_how = (f"{ranges} ranges per bundle x warm pread intercept {a_w * 1e3:.1f} us")
        cold_how = (f"{ranges} x (cold - warm pread intercept = {(a_c - a_w) * 1e3:.1f} us) - "
                    "one device latency")
    out = {
        "ssd_bandwidth_gbps": (round(bandwidth, 3), (
            f"buffered cold pread (FADV_RANDOM, after DONTNEED) slope minus warm slope: "
            f"{dev_ms_per_mib:.3f} ms/MiB over sizes {fmt_sizes} (cold ms: {cold_txt}); "
            f"O_DIRECT sequential 4 MiB reads gave {seq or float('nan'):.2f} GB/s")),
        "ssd_latency_ms": (round(latency, 4), (
            "O_DIRECT 4 KiB random read, QD1 (mean)" if st.direct_4k_ms >= 0
            else "cold minus warm pread intercept (O_DIRECT refused)")),
        "queue_depth": (int(qd), (
            f"fewest threads reaching 90% of the best aggregate O_DIRECT random 1 MiB "
            f"throughput (threads: GB/s = {queue_txt})")),
        "load_overhead_ms": (round(load, 4), load_how),
        "cold_overhead_ms": (round(cold, 4), cold_how),
        "memcpy_gbps": (round(memcpy, 3), f"1 / slope of warm pread time vs size (warm ms: "
                        f"{warm_txt}" + (f"; each batch after writing {st.flush_bytes / MIB:.0f} "
                                         "MiB, twice the last-level cache, so the source is "
                                         "in memory" if st.flush_bytes else "") + ")"),
    }
    if st.page_drop_us is not None:
        (few, many), (p_few, p_many) = st.page_drop_us, DROP_PAGES
        out["page_drop_us_per_page"] = (round(max(many - few, 0.0) / (p_many - p_few), 4), (
            f"POSIX_FADV_DONTNEED of cached ranges of {p_few} and {p_many} pages of the scratch "
            f"file: {few:.1f} and {many:.1f} us (medians): the slope per page, the kernel's work "
            "to drop a page (the engine's page-cache budget drops an evicted bundle's pages)"))
    if st.reclaim is not None:
        pages, extra_cpu_ms, reclaimed, extra_wall_ms = st.reclaim
        out["reclaim_us_per_page"] = (round(max(extra_cpu_ms, 0.0) * 1e3 / pages, 4), (
            f"calibration.reclaim_probe: a cold read of {pages} pages of the scratch file took "
            f"{extra_cpu_ms:.3f} ms more of the reading thread's CPU time (median of paired "
            f"rounds; wall time {extra_wall_ms:+.3f} ms) inside a memory control group at its "
            f"limit, its pages active, than outside it; the kernel took back {reclaimed:.2f} "
            "pages from the group per page read (memory.stat): the reading thread's direct "
            "reclaim, per page"))
    return out


def direct_cold_overhead(st: StorageResult, c: ComputeResult,
                         values: dict[str, tuple[Any, str]]) -> float | None:
    """cold_overhead_ms that makes a simulated O_DIRECT load of the measured bundle cost what
    the engine measured (O_DIRECT reads each range through an aligned bounce buffer, so a
    bundle costs more than a buffered cold read); None when not measured."""
    if not c.direct_bundle_ms == c.direct_bundle_ms:  # nan
        return None
    b = c.bundle_bytes
    memcpy = values["memcpy_gbps"][0]
    dev = values["ssd_latency_ms"][0] + b / (values["ssd_bandwidth_gbps"][0] * 1e9) * 1e3
    copy = b / (memcpy * 1e9) * 1e3 if memcpy else 0.0
    return max(c.direct_bundle_ms - dev - copy - values["load_overhead_ms"][0], 0.0)


def _rounded(values: list[float]) -> list[float]:
    return [round(x, 4) for x in values]


def glu_fit(glu_ms: dict[int, float]) -> tuple[float, float]:
    """(per-call ms, per-expert ms) of the quantized SwiGLU's time against K (the slope at
    least 1e-6 ms)."""
    ks = sorted(glu_ms)
    e0, e1 = linear_fit([float(k) for k in ks], [glu_ms[k] for k in ks], relative=False)
    return e0, max(e1, 1e-6)


def expert_rate_gbps(glu_ms: dict[int, float], bundle_bytes: int) -> float:
    """expert_gbps: a bundle's bytes over the SwiGLU's per-expert ms (GB/s)."""
    return bundle_bytes / (glu_fit(glu_ms)[1] / 1e3) / 1e9


def compute_values(c: ComputeResult, active_params: float | None = None
                   ) -> dict[str, tuple[Any, str]]:
    """Hardware keys (compute part) -> (value, how). The sim's decode compute per layer is
    resident_bytes / layers / mem_bandwidth (attention, norms, router, lm_head spread over
    layers) + expert_overhead + K x bundle / expert_gbps; with lazy_compute it runs at the
    main thread's syncs (synchronous decode loop and prefill; the lookahead loop queues it at
    once), a sync that finds work queued costing sync_overhead_ms more. Where the compute
    thread's CPU was measured, the figures are that CPU, not the probes' wall time: a probe's
    wall holds its own waits for the main thread's dispatch, which the sim charges apart, once
    per layer as a resident decode step waits (compute_wait_ms_per_layer, the first part of
    each layer's attention item: sim.compute_stream), so the non-expert figure is its CPU plus
    that wait."""
    cpu = bool(c.glu_cpu_ms) and c.non_moe_cpu_ms == c.non_moe_cpu_ms \
        and c.compute_wait_ms_per_layer == c.compute_wait_ms_per_layer  # all measured
    def per_k(ms: dict[int, float]) -> str:
        return ", ".join(f"K={k}: {ms[k]:.3f}" for k in sorted(ms))

    if cpu:
        glu, what, wall_txt = c.glu_cpu_ms, "the compute thread's CPU time of ", \
            f" (wall: {per_k(c.glu_ms)})"
        non_moe = c.non_moe_cpu_ms + c.layers * max(c.compute_wait_ms_per_layer, 0.0)
        non_moe_txt = (f"{c.non_moe_cpu_ms:.2f} ms of the compute thread's CPU (wall "
                       f"{c.non_moe_ms:.2f}) + {c.layers} x compute_wait_ms_per_layer "
                       f"{c.compute_wait_ms_per_layer:.4f} = {non_moe:.2f} ms")
    else:
        glu, what, wall_txt = c.glu_ms, "", ""
        non_moe = c.non_moe_ms
        non_moe_txt = f"{non_moe:.2f} ms"
    e0, e1 = glu_fit(glu)
    expert_bw = expert_rate_gbps(glu, c.bundle_bytes)
    mem_bw = c.resident_bytes / (non_moe / 1e3) / 1e9 if non_moe > 0 else 1.0
    out = {
        "mem_bandwidth_gbps": (round(mem_bw, 4), (
            f"resident bytes ({c.resident_bytes}) / the compute of a decode step with the routed "
            f"experts removed ({non_moe_txt}, router + attention + lm_head) on "
            f"{c.model}: the non-expert compute, as a rate")),
        "expert_gbps": (round(expert_bw, 4), (
            f"bundle bytes ({c.bundle_bytes}) / per-expert slope {e1:.4f} ms of {what}the "
            f"quantized SwiGLU (engine.paths.kernel.switch_glu, 1 token, 8 chained calls per "
            f"eval) on {c.model}: ms per call {per_k(glu)}{wall_txt}")),
        "expert_overhead_ms": (round(max(e0, 0.0), 4), (
            "intercept of that fit: fixed time of one layer's expert computation")),
        "sync_overhead_ms": (round(max(c.sync_ms, 0.0), 4), (
            f"(compute of a decode step with a host sync at every router {c.synced_compute_ms:.2f}"
            f" ms - with one eval per step {c.step_ms:.2f} ms) / {c.layers} layers; load-"
            "dependent: a sync hands work to MLX's CPU thread and waits for it")),
        "lazy_compute": (True, "MLX evaluates lazily: in the engine's synchronous decode loop "
                         "(exact and hot paths, whose routed ids come to the host while the graph "
                         "is built) and in prefill, compute runs at host syncs only. The staged "
                         "decode loop looks ahead with async eval and is never lazy: the sim "
                         "models it with the scenario key lookahead, which sim compare sets from "
                         "the trace"),
    }
    if c.handoff_ms == c.handoff_ms:  # not nan
        out["handoff_ms"] = (round(max(c.handoff_ms, 0.0), 4), (
            f"median over {c.handoff_reps} no-op read requests through the engine's reader "
            "threads (engine.readers.ReaderPool, 2 readers, help_main off), from the reader's "
            "start to the main thread's return from wait (event set, main-thread wake-up); "
            f"10th percentile {c.handoff_p10_ms:.4f} ms. The sim adds it to every wait on a "
            "reader's load"))
    if c.gil_handoff_ms == c.gil_handoff_ms:  # not nan
        out["gil_handoff_ms"] = (round(max(c.gil_handoff_ms, 0.0), 4), (
            f"median over {c.gil_handoff_reps} hand-overs of the GIL "
            "(calibration.compute_probes.gil_handoff_times): a thread asleep on it after a "
            "cold page read, as a reader thread, runs this long after the main thread, done "
            "with 0.5 or 1 ms of Python, lets it go (a wake-up across cores); 90th "
            f"percentile {c.gil_handoff_p90_ms:.4f} ms. The sim wakes a waiter this long after "
            "a release; it takes the lock if still free (sim.gil)"))
    per_page_us = page_slope_us(c.cold_page_cpu)
    if per_page_us == per_page_us and c.cold_read_cpu_ms == c.cold_read_cpu_ms:
        pages = c.cold_page_cpu[0][0]  # the probe's shortest read is one bundle's pages
        sizes = ", ".join(f"{n} pages {ms:.4f} ms" for n, ms in c.cold_page_cpu)
        out["cold_read_cpu_us_per_page"] = (round(per_page_us, 4), (
            f"least-squares slope of a cold buffered pread's thread CPU time over its pages "
            f"(calibration.compute_probes.cold_page_cpu, the model's own layer files, the "
            f"sizes in turns: {sizes}, medians): page allocation, page-cache insertion and the "
            "copy, per 4 KiB page. A cold read's CPU is cold_read_cpu_ms + pages x this "
            "(sim.loads)"))
        out["cold_read_cpu_ms"] = (round(max(c.cold_read_cpu_ms - pages * per_page_us / 1e3,
                                             0.0), 4), (
            f"the per-request part of a cold read's CPU: the median thread CPU time of "
            f"{c.cold_read_reps} cold bundle reads through the engine's store on one thread, "
            f"page cache dropped ({c.cold_read_cpu_ms:.4f} ms, calibration.compute_probes."
            f"cold_read_times; median wall {c.cold_read_wall_ms:.4f} ms), less its {pages} "
            "pages at cold_read_cpu_us_per_page. What the sim's load CPU (cold overhead, copy, "
            "per-read work) leaves out of a cold read's CPU runs on the cores beside the "
            "device time (sim.loads)"))
    elif c.cold_read_cpu_ms == c.cold_read_cpu_ms:  # not nan
        out["cold_read_cpu_ms"] = (round(max(c.cold_read_cpu_ms, 0.0), 4), (
            f"median thread CPU time of {c.cold_read_reps} cold bundle reads through the "
            "engine's store on one thread, page cache dropped "
            "(calibration.compute_probes.cold_read_times; their median wall "
            f"{c.cold_read_wall_ms:.4f} ms): the kernel's work for the requests, the pages "
            "and the copy. What the sim's load CPU (cold overhead, copy, per-read work) leaves "
            "out of it runs on the cores beside the device time (sim.loads)"))
    if c.reader_wake_ms == c.reader_wake_ms:  # not nan
        out["reader_wake_ms"] = (round(max(c.reader_wake_ms, 0.0), 4), (
            f"the same {c.handoff_reps} requests, from the submit to the idle reader's start "
            f"(queue put, its wake-up and claim); 10th percentile {c.reader_wake_p10_ms:.4f} "
            "ms. The sim starts a load handed to an idle reader this late (sim.reader_threads)"))
    if c.fill_host_ms == c.fill_host_ms:  # not nan
        out["fill_host_ms_per_load"] = (round(max(c.fill_host_ms, 0.0), 4), (
            f"calibration.fill_probe: the main thread's CPU in the staged path's slot placement "
            f"and settling (SlotTable.place, settle) over {c.fill_host_loads} loads of sampled "
            f"decode of {c.model} with the layer lead, every read on the reader threads: a "
            "staged fill's host work per expert it loads (sim.main_thread)"))
    if c.refused_warm_ms == c.refused_warm_ms:  # not nan
        out["refused_warm_ms"] = (round(max(c.refused_warm_ms, 0.0), 4), (
            f"engine store, read_bundle_if_warm on a cold bundle of {c.model} (10th "
            "percentile): the main thread's ask before it hands a demand miss out "
            "(engine.readers.wait, bundles up to INLINE_WARM_BYTES)"))
    if c.queue_ahead_ms == c.queue_ahead_ms:  # not nan
        out["queue_ahead_ms"] = (round(max(c.queue_ahead_ms, 0.0), 4), (
            f"median over {c.queue_ahead_reps} routers of a resident decode step, the walk to "
            f"each handed over with mx.async_eval as the engine's fill points do: the compute "
            f"still left when it returned, and the waiter's wake-up (it blocked "
            f"{c.async_blocked_ms:.3f} ms): MLX blocks the caller while more than 10 tasks are "
            "in flight, one operation each on its CPU backend (the sim's bounded queue, "
            "sim.compute_stream)"))
    if c.gather_queue_ahead_ms == c.gather_queue_ahead_ms:  # not nan
        out["gather_queue_ahead_ms"] = (round(max(c.gather_queue_ahead_ms, 0.0), 4), (
            f"median over {c.gather_queue_ahead_reps} layers of a resident decode step, each "
            "layer's experts handed over with mx.async_eval after its router's ids came to "
            "the host, as the engine's fill points hand a gather over: the compute still "
            "left when it returned (the same bound as queue_ahead_ms, ending in the experts' "
            "few large operations)"))
    if c.zero_fill_curve:
        rotations = [mib for mib, _ in c.zero_fill_curve]
        rates = [round(2**20 / (ms * 1e6), 3) for _, ms in c.zero_fill_curve]
        how = ("calibration.zero_fill_probe: alloc_stack (the exact path's zeroed stack, "
               f"evaluated) of about {STACK_MIB} MiB of the first MoE layer's bundles, each "
               "call reusing a buffer freed that many MiB of stacks before, less a one-bundle "
               f"call, medians of {TIMED} calls x {REPS}: bytes per second")
        out["zero_fill_gbps"] = (rates[0], f"{how}, at {rotations[0]:g} MiB (the buffer in "
                                 "the CPU's caches; zero_fill_rotation_* give the rest)")
        out["zero_fill_rotation_mib"] = (rotations, "MiB touched since the stack's buffer was "
                                         "last used (sim.zero_fill)")
        out["zero_fill_rotation_gbps"] = (rates, how)
    if c.expert_size_curve:
        out["expert_size_bytes"] = ([size for size, _ in c.expert_size_curve],
                                    "bundle bytes of the synthetic experts timed "
                                    "(calibration.expert_size_probe; sim.expert_kernel)")
        out["expert_size_gbps"] = ([round(expert_rate_gbps(ms, size), 4)
                                    for size, ms in c.expert_size_curve], (
            "calibration.expert_size_probe: bundle bytes / the per-expert slope of the compute "
            "thread's CPU time of the quantized SwiGLU (1 token, K " + "/".join(
                str(k) for k in sorted(c.expert_size_curve[0][1])) + ") on synthetic stacks "
            f"shaped like {c.model}'s experts, the intermediate size scaled; per K the 10th "
            "percentile of its repeats"))
    if c.cross_core_op_us == c.cross_core_op_us:  # not nan
        how = (f"calibration.handover_probe: a step of {c.cross_core_primitives} MLX primitives "
               f"(chains of small element-wise operations handed over in {PIECES} async_eval "
               "pieces, as a decode step's fill points do), each arm its own process, on every "
               f"core and pinned to one, alternating (medians of {c.cross_core_rounds}): per "
               "primitive, ")
        out["cross_core_op_us"] = (round(max(c.cross_core_op_us, 0.0), 4), how + (
            "the wall time more on every core (sim.main_thread: taken off each layer's "
            "compute where the threads share one core)"))
        out["cross_core_op_main_us"] = (round(max(c.cross_core_op_main_us, 0.0), 4), how + (
            "the main thread's CPU time more on every core (taken off the lookahead loop's "
            "dispatch there)"))
    if active_params and c.prefill_ms > 0 and c.prefill_tokens:
        tflops = 2 * active_params * c.prefill_tokens / (c.prefill_ms / 1e3) / 1e12
        out["compute_tflops"] = (round(tflops, 6), (
            f"prefill of {c.prefill_tokens} tokens, experts resident: {c.prefill_ms:.1f} ms for "
            f"2 x {active_params:.3g} active params per token"))
    return out


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB} KiB"


# ---------------------------------------------------------------------------------- writers


def hardware_values(st: StorageResult, c: ComputeResult, machine: dict[str, tuple[Any, str]], *,
                    active_params: float | None = None) -> dict[str, tuple[Any, str]]:
    """Every Hardware key -> (value, how it was measured). `machine`: ram_gib, os_reserve_gib,
    cpu_cores, compute_on_cpu as read on the machine (calibration.machine.facts)."""
    values = {
        **machine,
        **storage_values(st, c, c.bundle_reads),
        "readahead": (False, "the engine reads with POSIX_FADV_RANDOM: a cold read caches only "
                      "its own pages"),
        "cpu_factor": (1.0, "graph-building times in model profiles measured here are this "
                       "machine's (the paper's M-series reference cannot be measured here)"),
        "compute_tflops": (0.001, "not measured (no prefill timing)"),
        "slot_update_ms": (0.0, "this engine's staged path reads straight into slot rows from "
                           "reader threads (no main-thread copy): the write is the load itself"),
        **compute_values(c, active_params),
    }
    return values


def hardware_toml(values: dict[str, tuple[Any, str]], name: str, when: str, command: str,
                  extra_header: list[str] | None = None, machine: str = "") -> str:
    header = [f"{name}: measured by `{command}` on {when}.",
              f"Machine: {machine or 'not recorded'}.",
              "Every value says how it was measured; figures drift on shared storage (re-run "
              "to refresh).",
              *(extra_header or [])]
    order = tuple(k for k in HARDWARE_KEYS if k in values)
    return toml_text(header, values, order, f"{name} (measured by ssdmoe calibrate, {when})")


def write_hardware(path: Path, text: str) -> Path:
    """Write atomically, then check that load_hardware accepts what was written."""
    from sim.profiles import load_hardware, write_checked

    return write_checked(path, text, load_hardware)


def now_text() -> str:
    return _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def as_dict(obj: StorageResult | ComputeResult) -> dict[str, Any]:
    return asdict(obj)

