"""The exact path, the correctness baseline: per call, bring the routed indices to the host,
dedupe them, read each distinct expert's bundle from the store into a fresh stack, remap the
indices to stack rows, and run the shared kernel. No cache: every call reads from the store
(the OS page cache may still make the reads warm)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.paths.kernel import ExpertPath, Quant, alloc_stack, row_views, switch_glu
from engine.paths.stats import PathStats, host_routed
from engine.step_clock import StepClock
from engine.store import ExpertStore
from traces.schema import DEMAND


class ExactPath(ExpertPath):
    name = "exact"

    def __init__(self, store: ExpertStore, layer: int, source: str = DEMAND,
                 step_clock: StepClock | None = None, stats: PathStats | None = None):
        self.store = store
        self.stats = stats if stats is not None else PathStats()
        self.step_clock = step_clock if step_clock is not None else StepClock()
        self.layer = layer
        self.source = source
        self.quant = Quant.of(store.manifest)
        self.shapes = store.expert_shapes(layer)

    def fetch(self, experts: np.ndarray) -> dict[str, mx.array]:
        """Stacked tensors holding `experts` (distinct ids) in that row order."""
        arrays, views = alloc_stack(self.shapes, len(experts))
        for row, e in enumerate(experts.tolist()):
            self.store.read_bundle(self.layer, e, row_views(views, row), source=self.source,
                                   step=self.step_clock.step)
        return arrays

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        # evaluates the graph up to this router: a host sync, timed as compute (not building)
        host = host_routed(inds, self.stats)
        experts, local = np.unique(host, return_inverse=True)
        stack = self.fetch(experts)
        local_inds = mx.array(local.reshape(host.shape).astype(np.uint32))
        return switch_glu(x, stack, local_inds, self.quant)
