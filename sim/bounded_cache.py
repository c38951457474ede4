"""A byte-bounded cache over fixed-size items (expert bundles) whose victims an eviction policy
names (contract.eviction, the engine's own implementations; sim.belady). The engine's hot pool,
its bundle LRU and the page cache the engine's budget emulates are each one. Keys are ints
(layer * experts + expert) to keep lookups cheap; stamps are (step, layer)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from contract.eviction import DEFAULT, EvictionPolicy, Stamp, make


class BoundedCache:
    def __init__(self, capacity_bytes: int, item_bytes: int,
                 policy: str | EvictionPolicy = DEFAULT) -> None:
        if item_bytes <= 0:
            raise ValueError("item_bytes must be > 0")
        self.item_bytes = item_bytes
        self.capacity = max(int(capacity_bytes) // item_bytes, 0)  # in items
        self.policy = make(policy) if isinstance(policy, str) else policy
        self.items: dict[int, Any] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.peak_items = 0
        self.on_evict: Callable[[int], None] | None = None  # told each key pushed out

    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.item_bytes

    @property
    def used_bytes(self) -> int:
        return len(self.items) * self.item_bytes

    def __contains__(self, key: int) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def lookup(self, key: int, now: Stamp) -> bool:
        """True (and a use at `now`) when present; counts a hit or a miss."""
        if key in self.items:
            self.policy.use(key, now)
            self.hits += 1
            return True
        self.misses += 1
        return False

    def get(self, key: int, default: Any = None) -> Any:
        return self.items.get(key, default)

    def insert(self, key: int, now: Stamp, value: Any = None,
               keep: Collection[int] = ()) -> None:
        """Add `key` at `now` (or refresh a held one: a use), evicting the policy's victim
        outside `keep` beyond capacity (none outside it: the policy's first)."""
        if self.capacity == 0:
            return
        items = self.items
        if key in items:
            self.policy.use(key, now)
            items[key] = value
            return
        self.make_room(1, now, keep)
        items[key] = value
        self.policy.admit(key, now)
        if len(items) > self.peak_items:
            self.peak_items = len(items)

    def make_room(self, n: int, now: Stamp, keep: Collection[int] = ()) -> None:
        """Evict the policy's victims (outside `keep` while any is left) until `n` more keys
        fit: the engine's hot pool frees a call's rows before it admits the call's misses."""
        while self.items and len(self.items) + n > self.capacity:
            old = self.policy.victim(now, keep)
            if old is None:
                old = self.policy.victim(now)
            self.policy.remove(old)
            del self.items[old]
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old)

    def discard(self, key: int) -> None:
        self.items.pop(key, None)
        self.policy.remove(key)
