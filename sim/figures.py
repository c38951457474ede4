"""What a simulated run measures besides the trace's summary metrics: the simulator's own
figures, typed (a `SimResult.figures`). `as_dict()` is what run.json `extra.sim` records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SimFigures:
    sim_wall_s: float  # wall time of the whole run (routing, model, tables)
    sim_core_s: float  # the discrete-event run alone
    routing_s: float  # building the routing input
    sim_steps_per_s: float | None  # forward steps simulated per second of sim_core_s
    decode_steps: int
    page_cache_capacity_bytes: int  # what memory leaves the page cache (sim.memory_budget)
    page_cache_bytes: int  # expert bytes cached at the end
    page_cache_hit_rate: float | None
    lru_capacity_bytes: int  # the app cache (bundle LRU or slots as one LRU)
    lru_hit_rate: float | None
    device_busy_fraction: float | None
    device_requests: int
    reader_busy_fraction: float | None
    cpu_seconds_by_thread: dict[str, float]
    cpu_contended_fraction: float | None  # time more threads wanted a core than there were
    compute_busy_fraction: float | None
    swap_faults: int  # the engine's paged-out memory faulted back in (sim.swap)
    swap_fault_bytes: int
    build_ms_per_step: float | None  # decode steps' mean, as `trace summary` splits them
    eval_ms_per_step: float | None
    memory: dict[str, int] = field(default_factory=dict)  # sim.memory_budget.MemoryBudget.as_dict
    warnings: list[str] = field(default_factory=list)  # oversubscription and the like
    # CPU ms a decode step by thread: main, compute (MLX's), readers (all of them), as the
    # trace's cpu_ns splits into main_cpu_ns and the rest
    decode_cpu_ms_by_thread: dict[str, float] = field(default_factory=dict)
    # of it, the main thread's CPU ms a decode step by part (sim.main_thread.MAIN_PARTS)
    decode_main_cpu_ms_by_part: dict[str, float] = field(default_factory=dict)

    def as_dict(self, memory: bool = True) -> dict:
        d = asdict(self)
        if not memory:
            d.pop("memory")
        return d
