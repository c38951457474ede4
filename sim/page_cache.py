"""The OS page cache over the expert files: Linux's two lists (sim.two_list_lru,
Hardware.page_cache_policy "linux-two-list"), else a cache whose victims an eviction policy names
(sim.bounded_cache: "lru"; where the page cache is the engine's page-cache budget, the engine's
cache policy, Scenario.cache_policy) of bundle ranges (a bundle is the unit; finer
page granularity would cost events and buys nothing at bundle-sized reads). Capacity comes from
sim.memory_budget.budget. With O_DIRECT the engine bypasses it: every read is cold and nothing is
kept.

One exception to the bundle as the unit: tensor slices smaller than a page share their page with
the same slice of the other experts of their page group (the model profile's
`shared_page_reads` slices of a bundle, `page_group` experts a page: on the tiny fixtures the
scales and biases, 2 KiB each, two experts a page). The kernel caches pages, so a pread of such a
slice needs no device request while its group's page is cached, whichever expert's read brought
it in; and the engine's page-cache budget drops an evicted bundle's ranges rounded out to whole
pages, so pushing one expert out drops the page its group shares (`shared_missing`). A bundle
still held can then read cold (engine.store classes a load cold when any byte is not cached).
This follows the engine's emulated budget; the kernel's own LRU drops pages one by one, which
keeps a shared page while any of its experts is in use.
"""

from __future__ import annotations

from sim.bounded_cache import BoundedCache
from sim.two_list_lru import TwoListLRU

KERNEL = "linux-two-list"  # Hardware.page_cache_policy: the kernel's lists, not a contract policy
PAGE_CACHE_POLICIES = ("lru", KERNEL)  # the values Hardware.page_cache_policy takes


class PageCache:
    def __init__(self, capacity_bytes: int, bundle_bytes: int, experts: int,
                 enabled: bool = True, shared_reads: int = 0, page_group: int = 1,
                 policy: str = "lru") -> None:
        self.enabled = enabled and capacity_bytes > 0
        self.experts = experts
        capacity = capacity_bytes if enabled else 0
        self.lru = TwoListLRU(capacity, bundle_bytes) if policy == KERNEL else \
            BoundedCache(capacity, bundle_bytes, policy)
        # page sharing (module doc); off unless every group lies within one layer
        shared = self.enabled and page_group > 1 and experts % page_group == 0
        self.shared_reads = shared_reads if shared else 0
        self.page_group = page_group
        self.shared_pages: set[int] = set()  # page groups whose shared pages are cached
        if self.shared_reads:
            self.lru.on_evict = self._dropped

    def _dropped(self, key: int) -> None:
        self.shared_pages.discard(key // self.page_group)

    def shared_missing(self, key: int) -> int:
        """How many of this bundle's slices in pages shared with its page group must come from
        the device now (0: the group's pages are cached); the read then caches them."""
        if not self.shared_reads:
            return 0
        group = key // self.page_group
        if group in self.shared_pages:
            return 0
        self.shared_pages.add(group)
        return self.shared_reads

    @property
    def used_bytes(self) -> int:
        return self.lru.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.lru.capacity_bytes

    def probe(self, key: int, now: tuple[int, int]) -> bool:
        """Is this bundle resident? (a use at `now`, as a read of it would be)"""
        return self.enabled and self.lru.lookup(key, now)

    def holds(self, key: int) -> bool:
        """Is this bundle resident? (no recency change: a look, not a read)"""
        return self.enabled and key in self.lru

    def fill(self, key: int, now: tuple[int, int]) -> None:
        if self.enabled:
            if self.shared_reads:  # its pages cached, then the budget's drops (the engine's order)
                self.shared_pages.add(key // self.page_group)
            self.lru.insert(key, now)

    def probe_layer(self, layer: int, now: tuple[int, int]) -> int:
        """Number of the layer's bundles NOT resident; touches the resident ones."""
        if not self.enabled:
            return self.experts
        base = layer * self.experts
        return sum(1 for e in range(self.experts) if not self.lru.lookup(base + e, now))

    def fill_layer(self, layer: int, now: tuple[int, int]) -> None:
        if self.enabled:
            base = layer * self.experts
            for e in range(self.experts):
                self.lru.insert(base + e, now)
            if self.shared_reads:
                self.shared_pages.update(range(base // self.page_group,
                                               (base + self.experts) // self.page_group))
