"""Where a probe reads one bundle: per layer, a one-row expert stack's row as a read target
(the engine's own layout and read path: a staged slot's or a pool row's,
engine.paths.kernel)."""

from __future__ import annotations

from engine.paths.kernel import alloc_stack, row_targets
from engine.read_plan import ReadTarget
from engine.store import ExpertStore


def one_row_views(store: ExpertStore, layers: list[int]) -> dict[int, ReadTarget]:
    """Per layer, the read target of a one-row stack: where a probe reads one bundle."""
    views = {}
    for layer in layers:
        _, v = alloc_stack(store.expert_shapes(layer), 1)
        views[layer] = row_targets(v, 1)[0]
    return views
