"""The engine's caches: a bundle LRU shared by all layers (bounded in bytes) and per-layer staged
slots (double buffered: the set a layer computes with now, and the set being filled for the
next token). Values in the LRU are the Load that brought the bundle in (None once settled), so a
hit on a bundle still in flight waits for it instead of pretending it is there."""

from __future__ import annotations

from collections import deque

from sim.lru import LRU


class BundleLRU(LRU):
    """LRU of expert bundles keyed layer * experts + expert."""


class StagedSlots:
    """Per layer: `current` (experts the layer computed with last token, still in their slots)
    and `pending` (expert -> Load or None per future token, oldest first: what was staged for
    the next token; with the lookahead loop the token after it is staged before the next
    token's layer has taken its set, as the engine's per-layer queue of staged sets allows)."""

    def __init__(self, layers: int) -> None:
        self.current: list[frozenset[int]] = [frozenset()] * layers
        self.pending: list[deque[dict[int, object]]] = [deque() for _ in range(layers)]

    def stage(self, layer: int, staged: dict[int, object]) -> None:
        self.pending[layer].append(staged)

    def take(self, layer: int) -> dict[int, object] | None:
        """Swap buffers: the oldest pending set becomes current; returns it (None if nothing
        staged)."""
        pending = self.pending[layer]
        return pending.popleft() if pending else None

    def settle(self, layer: int, experts: frozenset[int]) -> None:
        self.current[layer] = experts
