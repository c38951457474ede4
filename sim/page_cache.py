"""The OS page cache over the expert files: an LRU of bundle ranges (a bundle is the unit; finer
page granularity would cost events and buys nothing at bundle-sized reads). Capacity comes from
sim.memory.budget. With O_DIRECT the engine bypasses it: every read is cold and nothing is kept.
"""

from __future__ import annotations

from sim.lru import LRU


class PageCache:
    def __init__(self, capacity_bytes: int, bundle_bytes: int, experts: int,
                 enabled: bool = True) -> None:
        self.enabled = enabled and capacity_bytes > 0
        self.experts = experts
        self.lru = LRU(capacity_bytes if enabled else 0, bundle_bytes)

    @property
    def used_bytes(self) -> int:
        return self.lru.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.lru.capacity_bytes

    def probe(self, key: int) -> bool:
        """Is this bundle resident? (marks it recently used, as a read of it would)"""
        return self.enabled and self.lru.lookup(key)

    def holds(self, key: int) -> bool:
        """Is this bundle resident? (no recency change: a look, not a read)"""
        return self.enabled and key in self.lru

    def fill(self, key: int) -> None:
        if self.enabled:
            self.lru.insert(key)

    def probe_layer(self, layer: int) -> int:
        """Number of the layer's bundles NOT resident; touches the resident ones."""
        if not self.enabled:
            return self.experts
        base = layer * self.experts
        return sum(1 for e in range(self.experts) if not self.lru.lookup(base + e))

    def fill_layer(self, layer: int) -> None:
        if self.enabled:
            base = layer * self.experts
            for e in range(self.experts):
                self.lru.insert(base + e)
