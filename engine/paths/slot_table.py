"""The staged path's slot table: per layer a fixed stack of S = K + headroom slots, and an MLX
uint32 table [E] (expert id -> slot) that the gather indexes on the device. A slot keeps its
expert while it stays routed; a missing expert is read by the reader threads straight into an
empty slot, else the slot of the victim the eviction policy names outside the protected ones
(contract.eviction; least recently used by default; its stamps are (call, layer): a per-layer
table's clock is its calls), and published in the table once its read lands. Row S is all zeros
and every absent expert maps to it. The fill strategies (on demand, staged ahead and verified,
predicted) are engine.paths.staged_fill's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from contract import eviction
from engine.paths.kernel import alloc_stack, row_targets
from engine.paths.stats import PathStats
from engine.readers import ReaderPool, Ticket
from engine.store import ExpertStore
from traces.schema import DEMAND, PREFETCH


class StagingError(RuntimeError):
    """The routing that a call executed was not what was staged for it (or no room to stage
    it)."""


class SlotTable:
    def __init__(self, store: ExpertStore, layer: int, readers: ReaderPool, stats: PathStats,
                 k: int, headroom: int, policy: str = eviction.DEFAULT):
        m = store.manifest
        self.layer, self.readers, self.stats = layer, readers, stats
        self.k, self.headroom = k, headroom
        self.slots = k + headroom
        # Slot rows 0..S-1 plus the zero row S that absent experts map to.
        self.arrays, self.views = alloc_stack(store.expert_shapes(layer), self.slots + 1)
        self.sentinel = self.slots
        self.table = mx.full((m.num_experts,), self.sentinel, dtype=mx.uint32)
        mx.eval(self.table)
        self.table_np = np.asarray(self.table)  # zero-copy: host writes land in MLX memory
        self.rows = row_targets(self.views, self.slots)
        # Host bookkeeping in plain lists: K is small, numpy per-call overhead is not.
        self.expert_in = [-1] * self.slots  # slot -> expert (-1 empty)
        self.ticket_of: dict[int, Ticket] = {}  # slot -> fill in flight / not yet waited
        self.policy = eviction.make(policy)  # over the experts held in slots
        self.clock = 0  # calls so far: the token of the policy's stamps
        self.last_call: set[int] = set()  # slots of the last call staged ahead (may still compute)
        self.hinted: set[int] = set()  # experts the last hint read: the next call's misses

    def resident(self) -> dict[int, int]:
        """{expert: slot} of filled slots (fills in flight included)."""
        return {e: s for s, e in enumerate(self.expert_in) if e >= 0}

    def place(self, wanted: list[int], protected: set[int], source: str) -> list[Ticket]:
        """Give every expert of `experts` a slot: survivors keep theirs, missing ones are read
        into empty slots, then into the policy's victims outside `protected`, the survivors
        and slots with a read in flight. Returns the tickets to wait on before these slots may
        be used."""
        self.clock += 1
        now = (self.clock, self.layer)
        where = self.resident()
        keep = {where[e] for e in wanted if e in where}
        missing = [e for e in wanted if e not in where]
        hinted = sum(1 for e in wanted if e in self.hinted)  # read for this call: misses
        self.hinted = set()
        self.stats.cache_hits += len(wanted) - len(missing) - hinted
        self.stats.cache_misses += len(missing) + hinted
        for e in wanted:
            if e in where:
                self.policy.use(e, now)
        free = self._room(len(missing), keep | protected | set(self.ticket_of), where, now)
        if len(free) < len(missing):
            raise StagingError(
                f"layer {self.layer}: {len(missing)} experts to stage but only {len(free)} free "
                f"slots of {self.slots} (K={self.k} + headroom {self.headroom}); raise the "
                "staged headroom")
        where.update(self._read_into(missing, free, now, source))
        slots = [where[e] for e in wanted]
        return [self.ticket_of[s] for s in slots if s in self.ticket_of]

    def _room(self, n: int, banned: set[int], where: dict[int, int], now) -> list[int]:
        """Up to `n` slots outside `banned`: empty ones, then the policy's victims."""
        free = [s for s in range(self.slots) if s not in banned and self.expert_in[s] < 0]
        kept = {self.expert_in[s] for s in banned}
        while len(free) < n:
            victim = self.policy.victim(now, kept)
            if victim is None:
                break
            kept.add(victim)  # chosen: not again
            free.append(where[victim])
        return free

    def _read_into(self, experts: list[int], slots: list[int], now, source: str
                   ) -> dict[int, int]:
        """Start reading each expert into its slot (the old one evicted); {expert: slot}."""
        placed = {}
        for e, s in zip(experts, slots, strict=False):
            old = self.expert_in[s]
            if old >= 0:
                self.table_np[old] = self.sentinel
                self.policy.remove(old)
                self.stats.cache_evictions += 1
            self.expert_in[s] = e  # the table entry stays at the sentinel until the read lands
            self.policy.admit(e, now)
            self.ticket_of[s] = self.readers.submit_bundle(self.layer, e, self.rows[s],
                                                           source=source,
                                                           now=source == DEMAND)
            placed[e] = s
        return placed

    def hint(self, experts: list[int]) -> None:
        """Start reading `experts` (a guess at the next call's set, engine.first_layer_hint)
        into free slots as prefetches, as far as slots allow: empty ones first, then the
        policy's victims, never a slot with a read in flight, and always leaving K slots
        without one, so the call's own misses still find room whatever the guess. Counts no
        hit or miss (the call that follows does) and never raises for want of room."""
        self.hinted = set()
        where = self.resident()
        busy = set(self.ticket_of)
        room = self.slots - len(busy) - self.k
        missing = [e for e in dict.fromkeys(experts) if e not in where][:max(0, room)]
        if not missing:
            return
        self.clock += 1
        now = (self.clock, self.layer)
        free = self._room(len(missing), busy, where, now)
        self.hinted = set(self._read_into(missing, free, now, PREFETCH))

    def reap(self) -> None:
        """Publish the reads that have landed without anyone waiting for them (hints the
        router did not pick): until then their slots count as busy."""
        done = [t for t in self.ticket_of.values() if t.done()]
        if done:
            self.settle(done)

    def settle(self, tickets: list[Ticket]) -> None:
        """Wait for `tickets`; publish landed experts in the table; empty slots whose read
        failed. Raises the first read error (after all of them are done)."""
        mine = {id(t) for t in tickets}
        try:
            self.readers.wait(tickets)
        finally:
            for s, t in list(self.ticket_of.items()):
                if id(t) not in mine:
                    continue
                del self.ticket_of[s]
                if t.error is None:
                    self.table_np[t.expert] = s
                else:
                    self.policy.remove(self.expert_in[s])
                    self.expert_in[s] = -1

    def all_published(self, experts) -> list[int] | None:
        """The short path of a fill: when every expert is already published in a slot, count
        the hits, refresh the slots' recency and return them; else None (nothing touched)."""
        table, sentinel = self.table_np, self.sentinel
        slots = [int(table[e]) for e in experts]
        if sentinel in slots:
            return None
        self.clock += 1
        now = (self.clock, self.layer)
        for e in experts:
            self.policy.use(e, now)
        self.stats.cache_hits += len(slots)
        return slots

    def slot_ids(self, inds: mx.array) -> mx.array:
        """The routed ids' slots, on the device (absent experts: the zero row)."""
        return mx.take(self.table, inds)

    def settle_all(self) -> None:
        """Wait for every read in flight (errors ignored: the caller is cleaning up)."""
        self.last_call = set()
        try:
            self.settle(list(self.ticket_of.values()))
        except Exception:  # noqa: BLE001 - the failed request already reported it
            pass

    def forget(self) -> None:
        """Empty every slot (reads settled first): each expert reads again on next use."""
        self.settle_all()
        self.expert_in = [-1] * self.slots
        self.policy.clear()
        self.table_np[:] = self.sentinel
