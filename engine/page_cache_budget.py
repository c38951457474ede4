"""The page-cache budget: the expert bytes a store has read kept within `limit` bytes, the pages
of the bundles the eviction policy names (contract.eviction; least recently read by default)
dropped with POSIX_FADV_DONTNEED (engine.platform), each bundle's ranges rounded out to whole
pages (what the kernel caches, and what the simulator's page cache charges:
sim.model_profile.paged_bundle_bytes). Reads on any thread charge it."""

from __future__ import annotations

import threading
from collections.abc import Callable

from contract import eviction

DropPages = Callable[[int, int, int], None]  # (fd, offset, length)


class PageCacheBudget:
    def __init__(self, limit: int, drop_pages: DropPages, page: int = 4096,
                 policy: str = eviction.DEFAULT) -> None:
        self.limit = limit
        self.page = page
        self._drop_pages = drop_pages
        self._lock = threading.Lock()
        self.policy = eviction.make(policy)  # over the bundles of _bundles
        # bundle -> (fd, page-rounded ranges, bytes)
        self._bundles: dict[tuple[int, int], tuple[int, list[tuple[int, int]], int]] = {}
        self.used_bytes = 0

    def charge(self, bundle: tuple[int, int], fd: int, ranges: list[tuple[int, int]],
               step: int = -1) -> None:
        """`bundle` (layer, expert) was just read from `fd` at `ranges` during `step`: it is
        used now, and the policy's victims are dropped until the rest fits (a bundle above the
        whole budget is dropped too)."""
        for dfd, off, ln in self.victims(bundle, fd, ranges, step):
            self._drop_pages(dfd, off, ln)

    def victims(self, bundle: tuple[int, int], fd: int, ranges: list[tuple[int, int]],
                step: int = -1) -> list[tuple[int, int, int]]:
        """`charge`'s accounting alone: the (fd, offset, length) extents to drop, for a caller
        that drops them itself (a native read, after its read: engine.native_reads)."""
        pages = page_extents(ranges, self.page)
        nbytes = sum(ln for _, ln in pages)
        now = (step, bundle[0])
        drop = []
        with self._lock:
            if bundle in self._bundles:
                self.policy.use(bundle, now)
            else:
                self._bundles[bundle] = (fd, pages, nbytes)
                self.policy.admit(bundle, now)
                self.used_bytes += nbytes
            while self.used_bytes > self.limit and len(self._bundles) > 1:
                drop.append(self._evict(self.policy.victim(now, (bundle,))))
            if self.used_bytes > self.limit:  # one bundle above the whole budget
                drop.append(self._evict(bundle))
        return [(dfd, off, ln) for dfd, dpages in drop for off, ln in dpages]

    def forget(self, layer: int | None = None) -> None:
        """The pages of every bundle (of `layer`) were dropped outside the budget."""
        with self._lock:
            for key in [k for k in self._bundles if layer is None or k[0] == layer]:
                self.used_bytes -= self._bundles.pop(key)[2]
                self.policy.remove(key)

    def _evict(self, bundle: tuple[int, int]) -> tuple[int, list[tuple[int, int]]]:
        fd, pages, nbytes = self._bundles.pop(bundle)
        self.policy.remove(bundle)
        self.used_bytes -= nbytes
        return fd, pages


def page_extents(ranges: list[tuple[int, int]], page: int) -> list[tuple[int, int]]:
    """The whole pages `ranges` touch, as (offset, length) extents: each range rounded out to
    pages, overlapping or adjacent ones merged (a bundled layout's slices share pages with each
    other, never with another expert's: one extent a bundle)."""
    out: list[list[int]] = []
    for off, ln in sorted(ranges):
        start, end = off - off % page, -(-(off + ln) // page) * page
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b - a) for a, b in out]
