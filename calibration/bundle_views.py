"""Where a probe reads one bundle: per layer, the views of a one-row expert stack (the
engine's own layout, engine.paths.kernel)."""

from __future__ import annotations

from engine.paths.kernel import alloc_stack, row_views
from engine.store import ExpertStore


def one_row_views(store: ExpertStore, layers: list[int]) -> dict[int, dict]:
    """Per layer, the views of a one-row stack: where a probe reads one bundle."""
    views = {}
    for layer in layers:
        _, v = alloc_stack(store.expert_shapes(layer), 1)
        views[layer] = row_views(v, 0)
    return views
