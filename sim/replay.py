"""Run a scenario: routing (trace or synthetic) -> the SimPy model (main thread, compute stream
and reader processes over the host's shared cores, the storage device, page cache, app caches
and memory) -> a simulated Trace (kind "simulated") + extra metrics."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import simpy

from contract.errors import BadInput
from sim.belady import Belady
from sim.caches import BundleLRU
from sim.compute_stream import ComputeStream
from sim.cpu import Cores
from sim.figures import SimFigures
from sim.gil import Gil
from sim.loads import Fetcher
from sim.main_thread import MAIN_PARTS, MainThread
from sim.memory_budget import MemoryBudget, budget
from sim.page_cache import PageCache
from sim.policies import Policy, make_policy
from sim.reader_threads import ReaderThreads
from sim.record import loads_frame, routing_frame, steps_frame
from sim.routing_input import DECODE_PATH_STEPS, RoutingInput, from_trace, synthetic
from sim.scenario import GIB, Scenario
from sim.storage import Device
from sim.swap import Swap
from sim.token_bucket import make_throttle
from traces.reader import Trace
from traces.run_info import RunInfo
from traces.schema import LOADS, ROUTING, SCHEMA_VERSION, STEPS
from traces.summary import summarize
from traces.writer import write_tables


@dataclass
class SimResult:
    trace: Trace
    metrics: dict[str, Any]  # SUMMARY_KEYS (same names/units as `trace summary`)
    figures: SimFigures  # the simulator's own figures (sim.figures)


def check_memory(sc: Scenario, mem: MemoryBudget) -> list[str]:
    """BadInput when RAM cannot even hold the OS (its reserve, or its floor where it gives way)
    and the resident weights; notes the OS giving way under pressure; when the
    rest does not fit, the breakdown and what the model does about it (returned, printed)."""
    where = sc.source or sc.name
    if mem.ram < mem.os_least + mem.resident:
        what = "OS reserve" if mem.os_floor < 0 else "OS floor under pressure"
        raise BadInput(f"{where}: ram_gib: {sc.hardware.ram_gib} GiB cannot hold the {what} "
                       f"({mem.os_least / GIB:.2f} GiB) and the resident weights of "
                       f"{sc.model.name} ({mem.resident / GIB:.2f} GiB)")
    gave = []
    if mem.os_held < mem.os_reserve:
        gave = [f"the OS and other processes gave way under memory pressure: they hold "
                f"{mem.os_held / GIB:.2f} GiB of their {mem.os_reserve / GIB:.2f} GiB (floor "
                f"{mem.os_floor / GIB:.2f} GiB), so the engine and the page cache's floor fit"]
    if not mem.oversubscribed:
        return gave
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in _parts(mem).items())
    return [f"memory oversubscribed by {mem.oversubscribed / GIB:.2f} GiB (RAM "
            f"{mem.ram / GIB:.2f} GiB; {parts}; page cache floor {mem.page_cache_floor / GIB:.2f}"
            f"): the page cache is held at {mem.page_cache / GIB:.2f} GiB and "
            f"{mem.swapped:.0%} of the engine's memory is paged out, so layers and app-cache "
            "hits fault it back in from the device (sim.swap)"] + gave


def _parts(mem: MemoryBudget) -> dict[str, int]:
    names = ("os_held", "resident", "kv", "heads", "adapter", "lru", "slots", "slot_views",
             "runtime")
    return {n: getattr(mem, n) for n in names if getattr(mem, n)}


@dataclass
class Model:
    """The simulated machine after a run: its processes, resources and memory."""
    main: MainThread
    fetcher: Fetcher
    device: Device
    readers: ReaderThreads | None
    cores: Cores
    compute: ComputeStream
    swap: Swap
    memory: MemoryBudget


def simulate(sc: Scenario, routing: RoutingInput) -> Model:
    m, hw = sc.model, sc.hardware
    mem = budget(sc)
    warnings = check_memory(sc, mem)
    if sc.path == "hot" and sc.lru_bytes < m.bundle_bytes:
        raise BadInput(f"{sc.source or sc.name}: lru_bytes: the hot path needs a bundle LRU of "
                       f"at least one bundle ({m.bundle_bytes} bytes)")
    env = simpy.Environment()
    device = Device(hw.ssd_latency_ms / 1e3, hw.ssd_bandwidth_gbps * 1e9, hw.queue_depth)
    if hw.throttle_read_mbps > 0:
        device.throttle_bytes = make_throttle(hw.throttle_kind, hw.throttle_read_mbps * 1e6,
                                             hw.throttle_burst_s)
    if hw.throttle_read_iops > 0:
        device.throttle_requests = make_throttle(hw.throttle_kind, hw.throttle_read_iops,
                                                hw.throttle_burst_s)
    # the exact path reads on the main thread (engine.paths.exact): no reader threads
    reader_threads = 0 if sc.path == "exact" else sc.readers
    threads = 1 + reader_threads + (1 if hw.compute_on_cpu else 0)  # main, readers, compute
    cores = Cores(env, hw.cpu_cores, hw.background_cores, threads)
    queue_ahead_s = hw.queue_ahead_ms / 1e3 if math.isfinite(hw.queue_ahead_ms) else None
    compute = ComputeStream(env, cores if hw.compute_on_cpu else None, hw.lazy_compute,
                            hw.sync_overhead_ms / 1e3, queue_ahead_s=queue_ahead_s)
    pc = PageCache(mem.page_cache, m.bundle_bytes, m.experts, enabled=not sc.o_direct,
                   shared_reads=m.shared_page_reads, page_group=m.page_group,
                   policy=sc.cache_policy if sc.engine_budget else hw.page_cache_policy)
    fetcher = Fetcher(env, hw, device, pc, cores, m.experts, m.bundle_bytes,
                      m.device_bundle_bytes, sc.budget_evict_ms,
                      Gil(env, sc.gil, hw.gil_handoff_ms / 1e3),
                      m.bundle_reads, sc.read_hold_ms, sc.read_hold_busy,
                      sc.direct_reclaim, sc.native_reads)
    readers = (ReaderThreads(env, reader_threads, fetcher, hw.handoff_ms / 1e3,
                             hw.reader_wake_ms / 1e3)
               if reader_threads > 0 else None)
    policy = make_policy(sc, routing.router, routing.predicted)
    lru = BundleLRU(sc.lru_bytes, m.bundle_bytes,
                    Belady(future_uses(routing.plan, policy, m.layers, m.experts))
                    if sc.cache_policy == "belady" else sc.cache_policy)
    swap = Swap(mem.swapped, device, hw.cold_overhead_ms / 1e3,
                (mem.resident + mem.kv) // m.layers)
    main = MainThread(env, sc, policy, cores, compute, fetcher, readers, lru, swap,
                      routing.hints if sc.first_layer_hint else None)
    main.warnings = warnings
    env.process(main.run(routing.plan))
    env.run()
    return Model(main, fetcher, device, readers, cores, compute, swap, mem)


def future_uses(plan: list[tuple[str, int, int, int]], policy: Policy, layers: int,
                experts: int) -> list[tuple[tuple[int, int], int]]:
    """Every (stamp, key) the shared cache will be asked for: each decode step's executed sets,
    stamped (step, layer) as sim.main_thread stamps them (Belady's future)."""
    return [((step, layer), layer * experts + e)
            for step, (phase, _, _, row) in enumerate(plan) if phase in DECODE_PATH_STEPS
            for layer in range(layers) for e in policy.executed(row, layer)]


def run_info(sc: Scenario, routing: RoutingInput, mem: MemoryBudget) -> RunInfo:
    m, hw = sc.model, sc.hardware
    scenario = {k: v for k, v in asdict(sc).items() if k not in ("hardware", "model")}
    return RunInfo(
        kind="simulated",
        model={"name": m.name, "architecture": "simulated", "layers": m.layers,
               "experts": m.experts, "k": sc.k, "bundle_bytes": m.bundle_bytes,
               "manifest_sha256": None},
        engine={"decode": sc.path, "k": sc.k, "lead_kind": sc.lead, "lru_bytes": sc.lru_bytes,
                "cache_policy": sc.cache_policy,
                "readers": sc.readers, "page_cache_budget": mem.page_cache,
                "staged_headroom": sc.headroom if sc.path == "staged" else None,
                "o_direct": sc.o_direct, "prerouter": sc.predicts and sc.lead == "token",
                "lora": None, "demand_pieces": sc.demand_pieces,
                "prefetch_pieces": sc.prefetch_pieces, "lookahead": sc.lookahead},
        machine={"profile": hw.name, **asdict(hw)},
        extra={"scenario": scenario, "model_profile": asdict(m), "memory": mem.as_dict(),
               "routing_source": routing.source},
    )


def run_scenario(sc: Scenario, trace: Trace | None = None,
                 routing: RoutingInput | None = None, out: str | Path | None = None) -> SimResult:
    """Simulate `sc` on the trace's routing, on `routing`, or on synthetic routing (in that
    order of preference). With `out`, also write the simulated trace directory there."""
    t0 = time.perf_counter()
    if routing is None:
        routing = from_trace(trace, sc) if trace is not None else synthetic(sc)
    t_routing = time.perf_counter() - t0
    t1 = time.perf_counter()
    model = simulate(sc, routing)
    main, fetcher, device, readers, mem = (model.main, model.fetcher, model.device,
                                           model.readers, model.memory)
    sim_s = time.perf_counter() - t1
    loads = loads_frame(fetcher.log, sc.hardware.readahead)
    steps = steps_frame(main.log, loads, mem, sc.model.kv_bytes_per_token, sc.context_tokens)
    # the steps that ran the decode path (one-token prefills too), as the engine records them
    decode_rows = [p for p in routing.plan if p[0] in DECODE_PATH_STEPS]
    decode_steps = np.asarray([i for i, p in enumerate(routing.plan)
                               if p[0] in DECODE_PATH_STEPS], dtype=np.int64)
    executed = np.asarray(main.executed_log, dtype=np.int16).reshape(
        len(decode_rows), sc.model.layers, sc.k)
    router = routing.router[[p[3] for p in decode_rows]] if decode_rows else executed
    staged = np.asarray([main.policy.staged_layer(layer) for layer in range(sc.model.layers)])
    hinted = [dict(main.hints.get(p[3], ())) for p in decode_rows]  # the ones replayed
    routing_df = routing_frame(executed, router, staged, decode_steps, hinted)
    info = run_info(sc, routing, mem)
    info.complete = True
    path = Path(out) if out is not None else Path(f"<simulated {sc.name}>")
    sim_trace = Trace(path, info.to_dict(), steps, routing_df, loads)
    if out is not None:
        write_trace(sim_trace, path)
    metrics = summarize(sim_trace)
    wall = time.perf_counter() - t0
    n_steps = len(routing.plan)
    lru, pc = main.lru, fetcher.pc
    figures = SimFigures(
        sim_wall_s=wall,
        sim_core_s=sim_s,
        routing_s=t_routing,
        sim_steps_per_s=n_steps / sim_s if sim_s > 0 else None,
        decode_steps=len(decode_rows),
        page_cache_capacity_bytes=pc.capacity_bytes,
        page_cache_bytes=pc.used_bytes,
        page_cache_hit_rate=_rate(pc.lru.hits, pc.lru.misses),
        lru_capacity_bytes=lru.capacity_bytes,
        lru_hit_rate=_rate(lru.hits, lru.misses),
        device_busy_fraction=device.busy_s / main.now if main.now > 0 else None,
        device_requests=device.requests,
        reader_busy_fraction=(readers.busy_s / (main.now * readers.n)
                              if readers is not None and main.now > 0 else None),
        cpu_seconds_by_thread=dict(model.cores.busy_s),
        cpu_contended_fraction=(model.cores.contended_s / main.now if main.now > 0
                                else None),
        compute_busy_fraction=model.compute.busy_s / main.now if main.now > 0 else None,
        swap_faults=model.swap.faults,
        swap_fault_bytes=model.swap.fault_bytes,
        build_ms_per_step=_mean_ms(steps, "build_ns"),
        eval_ms_per_step=_mean_ms(steps, "eval_ns"),
        memory=mem.as_dict(),
        warnings=main.warnings,
        decode_cpu_ms_by_thread={k: v * 1e3 / len(decode_rows)
                                 for k, v in sorted(main.decode_cpu_s.items())}
        if decode_rows else {},
        decode_main_cpu_ms_by_part={k: main.decode_main_parts[k] * 1e3 / len(decode_rows)
                                    for k in MAIN_PARTS} if decode_rows else {},
    )
    sim_trace.run["extra"]["sim"] = figures.as_dict(memory=False)
    return SimResult(sim_trace, metrics, figures)


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def _mean_ms(steps: Any, col: str) -> float | None:
    decode = steps.filter(steps["phase"] == "decode")
    return float(decode[col].mean()) / 1e6 if decode.height else None


def write_trace(trace: Trace, directory: Path) -> None:
    write_tables(directory, {STEPS: trace.steps, ROUTING: trace.routing, LOADS: trace.loads},
                 {**trace.run, "schema_version": SCHEMA_VERSION})
