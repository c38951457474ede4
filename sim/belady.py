"""Belady's optimal eviction (MIN: evict the key next used furthest in the future), the bound no
policy can beat at a given cache size. It needs the future, so only the simulator runs it: the
replay gives it every key's uses, stamped (step, layer), from the routing it is about to
execute. A key never used again goes first; ties go to the least recently used."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from contract.eviction import EvictionPolicy, Key, Stamp

NEVER = (1 << 62, 0)  # the next use of a key not used again


class Belady(EvictionPolicy):
    name = "belady"

    def __init__(self, uses: Iterable[tuple[Stamp, Key]]) -> None:
        """`uses`: every (stamp, key) the cache will be asked for, in any order."""
        super().__init__()
        self.future: dict[Key, list[Stamp]] = {}
        for stamp, key in uses:
            self.future.setdefault(key, []).append(stamp)
        for stamps in self.future.values():
            stamps.sort()
        self._next: dict[Key, int] = {}  # key -> index of its next use in future[key]
        self.now: Stamp = (-(1 << 62), 0)

    def next_use(self, key: Key) -> Stamp:
        """The first use of `key` after the latest stamp seen."""
        stamps = self.future.get(key, ())
        i = self._next.get(key, 0)
        while i < len(stamps) and stamps[i] <= self.now:
            i += 1
        self._next[key] = i
        return stamps[i] if i < len(stamps) else NEVER

    def use(self, key: Key, now: Stamp) -> None:
        super().use(key, now)
        self.now = max(self.now, now)

    def admit(self, key: Key, now: Stamp) -> None:
        super().admit(key, now)
        self.now = max(self.now, now)

    def victim(self, now: Stamp, keep: Collection[Key] = ()) -> Key | None:
        self.now = max(self.now, now)
        best, best_use = None, None
        for k in self._recent:  # least recent first: ties keep the earliest
            if k in keep:
                continue
            nxt = self.next_use(k)
            if best_use is None or nxt > best_use:
                best, best_use = k, nxt
        return best

    def order(self) -> list[Key]:
        rank = {k: i for i, k in enumerate(self._recent)}
        return sorted(self._recent, key=lambda k: (self.next_use(k), -rank[k]), reverse=True)
