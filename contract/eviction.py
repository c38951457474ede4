"""Eviction policies of the engine's caches and the simulator's, one implementation for both
(MLX-free). A cache holds keys (a bundle, (layer, expert), or the simulator's int for it). It
tells its policy each use of a held key and each admission, with the stamp (token, layer) at
which it happens; it asks for a victim outside the keys it must keep; and it says what left.

  lru          least recently used: the engine's behaviour before policies existed (default)
  fifo         first in, first out: a hit changes nothing (a baseline)
  lfu          least frequently used, with aging: each use adds one to the key's count; each
               time the cache has seen `window_per_key` (10) uses per key it holds, every count
               halves, so experts that were popular long ago make way (TinyLFU's reset:
               Einziger et al., ACM ToS 2017, with its sample of 10 per cache entry). Ties go
               to the least recent.
  least-stale  SpecMD's Least-Stale (Hoang et al., "SpecMD", arXiv 2602.03921), as we read it
               from its abstract (the rule's text was not available to us; docs/policies.md
               says what that means): experts are used layer by layer within a token, so a key
               used earlier in the current token is not asked for again until the next token,
               while one left from an earlier token at a layer still ahead may be asked for
               any moment. The victim is the most recently used key of the current token (the
               token of the latest stamp) outside those kept; only when there is none does the
               least recently used key of an earlier token go (a victim asked for at a new
               token's stamp sees every held key as earlier). A per-layer table (the staged
               slots) never holds an unkept key of the current call, so there it is LRU.
  belady       the simulator only (sim.belady): the key next used furthest in the future, the
               bound no policy can beat.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterator
from typing import ClassVar

from contract.errors import BadInput

Stamp = tuple[int, int]  # (token, layer): when a key is used; later stamps compare greater
Key = Hashable

ENGINE_POLICIES = ("lru", "lfu", "least-stale", "fifo")
SIM_ONLY = ("belady",)  # needs the future: the trace's routing
POLICIES = ENGINE_POLICIES + SIM_ONLY
DEFAULT = "lru"


class EvictionPolicy(ABC):
    name: ClassVar[str]

    def __init__(self) -> None:
        # held keys, least recently used first (every policy keeps recency: ties and order)
        self._recent: OrderedDict[Key, Stamp] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self._recent

    def __len__(self) -> int:
        return len(self._recent)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._recent)

    def use(self, key: Key, now: Stamp) -> None:
        """A held key was used at `now` (a hit)."""
        self._recent[key] = now
        self._recent.move_to_end(key)

    def admit(self, key: Key, now: Stamp) -> None:
        """A key not held enters at `now` (a miss filled): its first use."""
        self._recent[key] = now

    def remove(self, key: Key) -> None:
        """The key left the cache (evicted, or forgotten by its owner)."""
        self._recent.pop(key, None)

    def victim(self, now: Stamp, keep: Collection[Key] = ()) -> Key | None:
        """The next key to evict outside `keep` (None when every held key is kept), asked for
        at `now` (the stamp of the use that needs the room). Does not remove it: the cache
        does, and says so with `remove`."""
        return next((k for k in self.order() if k not in keep), None)

    @abstractmethod
    def order(self) -> list[Key]:
        """Every held key, the next victim first."""

    def clear(self) -> None:
        self._recent.clear()


class LRU(EvictionPolicy):
    name = "lru"

    def victim(self, now: Stamp, keep: Collection[Key] = ()) -> Key | None:
        return next((k for k in self._recent if k not in keep), None)

    def order(self) -> list[Key]:
        return list(self._recent)


class FIFO(LRU):
    """LRU's order with no refresh: the oldest admission goes first."""
    name = "fifo"

    def use(self, key: Key, now: Stamp) -> None:
        pass  # a hit changes nothing


class LFU(EvictionPolicy):
    name = "lfu"

    def __init__(self, window_per_key: int = 10) -> None:
        super().__init__()
        self.window_per_key = window_per_key
        self.count: dict[Key, int] = {}
        self._uses = 0  # since the last halving

    def use(self, key: Key, now: Stamp) -> None:
        super().use(key, now)
        self.count[key] += 1
        self._aged()

    def admit(self, key: Key, now: Stamp) -> None:
        super().admit(key, now)
        self.count[key] = 1
        self._aged()

    def remove(self, key: Key) -> None:
        super().remove(key)
        self.count.pop(key, None)

    def clear(self) -> None:
        super().clear()
        self.count.clear()
        self._uses = 0

    def _aged(self) -> None:
        self._uses += 1
        if self._uses >= self.window_per_key * len(self.count):
            self._uses = 0
            for k in self.count:
                self.count[k] //= 2

    def victim(self, now: Stamp, keep: Collection[Key] = ()) -> Key | None:
        # one pass, no sort: a victim is asked for on every miss of a full cache
        best = min(((self.count[k], i, k) for i, k in enumerate(self._recent) if k not in keep),
                   default=None)
        return None if best is None else best[2]

    def order(self) -> list[Key]:
        rank = {k: i for i, k in enumerate(self._recent)}  # ties: least recent first
        return sorted(self._recent, key=lambda k: (self.count[k], rank[k]))


class LeastStale(EvictionPolicy):
    name = "least-stale"

    def __init__(self) -> None:
        super().__init__()
        self.token = -(1 << 62)  # the current token: that of the latest stamp

    def use(self, key: Key, now: Stamp) -> None:
        super().use(key, now)
        self.token = max(self.token, now[0])

    def admit(self, key: Key, now: Stamp) -> None:
        super().admit(key, now)
        self.token = max(self.token, now[0])

    def victim(self, now: Stamp, keep: Collection[Key] = ()) -> Key | None:
        self.token = max(self.token, now[0])
        # order()'s first unkept key without building it: a victim is asked for on every miss
        recent = self._recent
        current = next((k for k in reversed(recent)
                        if recent[k][0] >= self.token and k not in keep), None)
        if current is not None:
            return current
        return next((k for k, (token, _) in recent.items()
                     if token < self.token and k not in keep), None)

    def order(self) -> list[Key]:
        current = [k for k, (token, _) in self._recent.items() if token >= self.token]
        older = [k for k, (token, _) in self._recent.items() if token < self.token]
        return current[::-1] + older


FACTORIES: dict[str, Callable[[], EvictionPolicy]] = {
    p.name: p for p in (LRU, FIFO, LFU, LeastStale)}


def check_policy(name: str, where: str = "cache policy", engine: bool = True) -> str:
    """`name` if it is a policy `where` can run, else one line naming it and the choices."""
    if engine and name in SIM_ONLY:
        raise BadInput(f"{where}: {name!r} needs the future (the next use of every expert): "
                       "only the simulator can run it, on a trace's routing (`ssdmoe sim run "
                       "... --set cache_policy=belady`)")
    known = ENGINE_POLICIES if engine else POLICIES
    if name not in known:
        raise BadInput(f"{where}: unknown policy {name!r} (one of: {', '.join(known)})")
    return name


def make(name: str) -> EvictionPolicy:
    """A new engine-side policy by name (Belady is the simulator's: sim.belady)."""
    return FACTORIES[check_policy(name)]()
