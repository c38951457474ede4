"""Linux's page-cache replacement without multi-generational LRU (mm/vmscan.c, mm/swap.c,
mm/workingset.c), over fixed-size items (bundles), with the interface of
sim.bounded_cache.BoundedCache so the page cache can use either (the stamps it is given are
ignored: the kernel's lists know no tokens).

- A page read for the first time enters the inactive list (its read marks it referenced).
- A page read again while inactive is activated (mark_page_accessed: referenced, then active);
  a read while active keeps it active (moved to the head here).
- Reclaim takes the inactive list's tail. Before that, while the inactive list is smaller than
  the active one (inactive_is_low with an inactive ratio of 1, what file lists below 1 GiB get),
  the active list's tail is demoted to the inactive head.
- Workingset detection: an evicted page leaves a shadow entry stamped with the count of
  evictions so far; when it is read again (a refault), the evictions since then are its refault
  distance, and a page whose distance is at most the active list's size is activated at once
  (it would have stayed cached had the active list been inactive).

So a bundle read once and never again is evicted before one read twice, where a plain LRU would
evict whichever was read longest ago: streamed-once experts do not push out the hot ones."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class TwoListLRU:
    def __init__(self, capacity_bytes: int, item_bytes: int) -> None:
        if item_bytes <= 0:
            raise ValueError("item_bytes must be > 0")
        self.item_bytes = item_bytes
        self.capacity = max(int(capacity_bytes) // item_bytes, 0)  # in items
        self.inactive: OrderedDict[int, Any] = OrderedDict()  # tail first, head last
        self.active: OrderedDict[int, Any] = OrderedDict()
        self.shadow: dict[int, int] = {}  # evicted key -> evictions counted when it left
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.peak_items = 0
        self.on_evict: Callable[[int], None] | None = None

    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.item_bytes

    @property
    def used_bytes(self) -> int:
        return len(self) * self.item_bytes

    def __contains__(self, key: int) -> bool:
        return key in self.inactive or key in self.active

    def __len__(self) -> int:
        return len(self.inactive) + len(self.active)

    def _touch(self, key: int) -> bool:
        """A read of a cached `key`: inactive -> active, active refreshed. False when absent."""
        if key in self.active:
            self.active.move_to_end(key)
        elif key in self.inactive:
            self.active[key] = self.inactive.pop(key)
        else:
            return False
        return True

    def lookup(self, key: int, now: tuple[int, int] = (0, 0)) -> bool:
        """A read of `key`: True when cached (then inactive -> active, active refreshed)."""
        if self._touch(key):
            self.hits += 1
            return True
        self.misses += 1
        return False

    def get(self, key: int, default: Any = None) -> Any:
        return self.active.get(key, self.inactive.get(key, default))

    def insert(self, key: int, now: tuple[int, int] = (0, 0), value: Any = None) -> None:
        """A page read into the cache: inactive, or active when it refaults within the active
        list's size; then reclaim down to capacity."""
        if self.capacity == 0:
            return
        if self._touch(key):  # a refresh, not a read: no hit counted
            return
        stamp = self.shadow.pop(key, None)
        if stamp is not None and self.evictions - stamp <= len(self.active):
            self.active[key] = value
        else:
            self.inactive[key] = value
        while len(self) > self.capacity:
            self._reclaim_one()
        self.peak_items = max(self.peak_items, len(self))

    def _reclaim_one(self) -> None:
        while self.active and len(self.inactive) < len(self.active):
            old, v = self.active.popitem(last=False)
            self.inactive[old] = v
            self.inactive.move_to_end(old, last=True)
        victims = self.inactive if self.inactive else self.active
        old, _ = victims.popitem(last=False)
        self.evictions += 1
        self.shadow[old] = self.evictions
        if self.on_evict is not None:
            self.on_evict(old)

    def discard(self, key: int) -> None:
        self.inactive.pop(key, None)
        self.active.pop(key, None)
