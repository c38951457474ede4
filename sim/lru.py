"""A byte-bounded LRU over fixed-size items (expert bundles). Shared by the OS page cache model
and the engine's bundle LRU. Keys are ints (layer * experts + expert) to keep lookups cheap."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class LRU:
    def __init__(self, capacity_bytes: int, item_bytes: int) -> None:
        if item_bytes <= 0:
            raise ValueError("item_bytes must be > 0")
        self.item_bytes = item_bytes
        self.capacity = max(int(capacity_bytes) // item_bytes, 0)  # in items
        self.items: OrderedDict[int, Any] = OrderedDict()
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

    def lookup(self, key: int) -> bool:
        """True (and mark most recent) when present; counts a hit or a miss."""
        items = self.items
        if key in items:
            items.move_to_end(key)
            self.hits += 1
            return True
        self.misses += 1
        return False

    def get(self, key: int, default: Any = None) -> Any:
        return self.items.get(key, default)

    def insert(self, key: int, value: Any = None) -> None:
        """Add (or refresh) `key` as most recent, evicting the least recent beyond capacity."""
        if self.capacity == 0:
            return
        items = self.items
        if key in items:
            items.move_to_end(key)
            items[key] = value
            return
        items[key] = value
        if len(items) > self.capacity:
            old, _ = items.popitem(last=False)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old)
        elif len(items) > self.peak_items:
            self.peak_items = len(items)

    def discard(self, key: int) -> None:
        self.items.pop(key, None)
