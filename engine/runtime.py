"""The per-model objects the execution paths share, built from an `EngineConfig`: the reader
pool, the hot LRU pool, the whole-layer double stack, the counters, the step clock, and one
path per (layer, phase). `load_streaming` builds it into the Engine it returns:

    engine.runtime.config.to_dict()   # run.json "engine"
    engine.stats.snapshot()           # cumulative cache_hits/misses/evictions, blocked_ns, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from contract.engine_config import PHASES, SYNC_AT_BUILD, EngineConfig
from engine.fill_points import FillPoints
from engine.paths.exact import ExactPath
from engine.paths.hot import HotPath, HotPool
from engine.paths.kernel import ExpertPath
from engine.paths.staged import StagedPath
from engine.paths.stats import PathStats
from engine.paths.whole_layer import WholeLayerLoader, WholeLayerPath
from engine.prerouter import PrerouteLink
from engine.queue_depth import default_readers
from engine.readers import ReaderPool
from engine.step_clock import StepClock
from engine.store import ExpertStore

if TYPE_CHECKING:  # engine.lora imports mlx-lm's tuner; only the type is needed here
    from engine.lora import Installed


@dataclass
class Runtime:
    config: EngineConfig
    store: ExpertStore
    stats: PathStats
    readers: ReaderPool
    hot: HotPool | None = None
    whole: WholeLayerLoader | None = None
    paths: dict[tuple[int, str], ExpertPath] = field(default_factory=dict)
    fills: FillPoints = field(default_factory=FillPoints)
    preroute: PrerouteLink | None = None  # installed prerouter heads (engine.prerouter)
    lora: Installed | None = None  # the recovery LoRA applied to the model (engine.lora)

    @property
    def step_clock(self) -> StepClock:
        """The step loads are labelled with (engine.step_clock), shared by every path."""
        return self.fills.clock

    def path(self, layer: int, phase: str) -> ExpertPath:
        return self.paths[(layer, phase)]

    def staged(self, phase: str = "decode") -> dict[int, StagedPath]:
        """{layer: StagedPath} of the layers running staged in `phase` (what a prerouter, or
        prefetch.RoutingReplay, drives)."""
        return {i: p for (i, ph), p in self.paths.items()
                if ph == phase and isinstance(p, StagedPath)}

    def syncs_at_build(self, phase: str = "decode") -> list[int]:
        """Layers whose `phase` path brings routed ids to the host while the graph is built
        (exact): the decode loop cannot build step t+1 ahead past such a layer."""
        return sorted(i for (i, ph), p in self.paths.items()
                      if ph == phase and p.name in SYNC_AT_BUILD)

    def buffer_bytes(self) -> dict[str, int]:
        """Preallocated expert buffers by component (the streaming machinery's memory)."""
        bundle = self.store.manifest.bundle_bytes
        seen = {id(p): p for p in self.paths.values() if isinstance(p, StagedPath)}
        return {
            "hot": self.hot.nbytes if self.hot else 0,
            "whole_layer": self.whole.nbytes if self.whole else 0,
            "staged": sum((p.slots + 1) * bundle for p in seen.values()),
        }

    def reset(self) -> None:
        """Settle reads in flight and drop queued staging (e.g. after a failed request)."""
        for p in {id(p): p for p in self.paths.values()}.values():
            p.reset()
        if self.whole:
            self.whole.reset()
        if self.preroute is not None:
            self.preroute.reset()

    def forget(self, layers: set[int]) -> None:
        """Drop every loaded expert of `layers` (slots, hot rows, staging): their file
        changed, so what was read from it is not trusted."""
        self.reset()
        for p in {id(p): p for (i, _), p in self.paths.items() if i in layers}.values():
            p.forget()
        if self.hot:
            self.hot.forget(layers)

    def close(self) -> None:
        self.readers.close()


def build_runtime(config: EngineConfig, store: ExpertStore) -> Runtime:
    m = store.manifest
    config.validate(m)
    if config.readers is None:
        config.readers, config.readers_source = default_readers(m.root, m.bundle_bytes)
    elif not config.readers_source:
        config.readers_source = "given"
    stats = PathStats()
    clock = StepClock()
    readers = ReaderPool(store, config.readers, stats, config.help_reads, clock,
                         native=config.native_reads)
    config.readers_kind = readers.kind if readers.kind == "native" else \
        f"python: {readers.why_python}"
    rt = Runtime(config, store, stats, readers, fills=FillPoints(clock))
    layers = m.moe_layers
    if config.uses("hot", layers):
        expert_bytes = m.bundle_bytes * m.num_experts * len(layers)
        rt.hot = HotPool(store, rt.readers, stats, config.resolved_hot_bytes(expert_bytes),
                         config.cache_policy)
    if config.uses("whole-layer", layers):
        rt.whole = WholeLayerLoader(store, rt.readers, stats)
    shared: dict[tuple[int, str], ExpertPath] = {}  # one exact/hot/staged per layer
    for phase in PHASES:
        wl = [i for i in layers if config.path_for(i, phase) == "whole-layer"]
        for i in layers:
            kind = config.path_for(i, phase)
            if kind == "whole-layer":
                nxt = wl[wl.index(i) + 1] if wl.index(i) + 1 < len(wl) else None
                rt.paths[(i, phase)] = WholeLayerPath(store, i, rt.whole, nxt)
                continue
            if (i, kind) not in shared:
                if kind == "exact":
                    shared[(i, kind)] = ExactPath(store, i, step_clock=clock, stats=stats)
                elif kind == "hot":
                    shared[(i, kind)] = HotPath(store, i, rt.hot, rt.fills)
                else:
                    shared[(i, kind)] = StagedPath(store, i, rt.readers, stats,
                                                   config.staged_headroom, rt.fills,
                                                   config.cache_policy)
            rt.paths[(i, phase)] = shared[(i, kind)]
    return rt
