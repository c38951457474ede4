"""The staged path, the decode workhorse: per layer a fixed stack of S = K + headroom slots,
preallocated once. A slot table (an MLX uint32 array [E], expert id -> slot) maps routed ids
to slots on the device with `take`, so the gather never needs the ids on the host. Experts
that stay routed keep their slot ("sticky"); only changed slots are rewritten, in place, by
reader threads doing `os.preadv` straight into the slot rows (the paper's incr_stack without
its main-thread copy). The slots and their table are engine.paths.slot_table's; this module
is how they get filled.

Three ways the slots get filled:
- on demand (no prerouter): the router's ids come to the host, the missing experts are read
  into free slots and waited for, then the gather runs. The sync is the honest price of not
  knowing the routing ahead. Inside the decode loop (`FillPoints.collecting`) the call only
  builds the gather and registers a fill point: the loop does the sync and the fill during
  evaluation, after the whole step's graph is built (engine.fill_points). Called anywhere else
  it syncs at build time (`host_routed`), counted and timed either way.
- staged ahead (`stage(experts)`, driven by a prerouter, or today by `RoutingReplay`): the
  next call's experts are read while the current step computes; the call then waits only for
  reads still in flight and does NOT sync: routing stays on the device. The staged set is
  checked against the router's actual ids after the step (`verify`, on already evaluated
  arrays); a routed expert that was not staged raises, it is never silently dropped. Inside
  the decode loop the wait, too, moves to a fill point.
- predicted (`predicted(x, inds)`, with a prerouter, engine.prerouter): the ids were
  predicted during the previous call and ARE the routing, so staged set and routed set are
  one; the staging is a wait-only fill point that the decode loop resolves as it starts the
  step, without stopping the compute thread (engine.fill_points).

Double buffering is per slot: new experts are only written into slots that no queued or
in-flight call uses, so with headroom >= K a fill for step t+1 never touches step t's slots
(or their table entries). The last call's slots count as in flight until the next call: with
the loop's lookahead, step t+1 is staged while step t may still compute (staging two steps
ahead then needs headroom 2K). Row S (one past the last slot) is all zeros and the table maps
every absent expert to it, so an unstaged expert can only produce zeros, which `verify`
turns into an error.

A call whose distinct experts exceed the slots (a multi-token call) falls back to the exact
path for that call; slots are left untouched."""

from __future__ import annotations

from collections import deque

import mlx.core as mx
import numpy as np

from engine.fill_points import FillPoint, FillPoints
from engine.paths.exact import ExactPath
from engine.paths.kernel import ExpertPath, Quant, switch_glu
from engine.paths.slot_table import SlotTable, StagingError
from engine.paths.stats import PathStats, host_routed
from engine.readers import ReaderPool, Ticket
from engine.store import ExpertStore
from traces.schema import DEMAND, PREFETCH


class StagedPath(ExpertPath):
    name = "staged"
    takes_predicted = True

    def __init__(self, store: ExpertStore, layer: int, readers: ReaderPool, stats: PathStats,
                 headroom: int | None = None, points: FillPoints | None = None):
        m = store.manifest
        self.store, self.layer, self.readers, self.stats = store, layer, readers, stats
        self.points = points if points is not None else FillPoints()
        self.k = m.top_k
        self.headroom = self.k if headroom is None else int(headroom)
        if self.headroom < 0:
            raise ValueError(f"staged headroom must be >= 0, got {self.headroom}")
        self.quant = Quant.of(store.manifest)
        self.slot_table = SlotTable(store, layer, readers, stats, self.k, self.headroom)
        self.queue: deque[list[int]] = deque()  # staged sets (sorted ids), one per future call
        self.checks: list[tuple[mx.array, list[int]]] = []  # (routed ids, staged set)
        self.in_use: set[int] = set()  # slots of the last call staged ahead (may still compute)
        self.exact = ExactPath(store, layer, step_clock=self.points.clock, stats=stats)

    # ------------------------------------------------------------ the slot table's

    @property
    def slots(self) -> int:
        return self.slot_table.slots

    @property
    def sentinel(self) -> int:
        """The zero row absent experts map to."""
        return self.slot_table.sentinel

    @property
    def views(self):
        return self.slot_table.views

    def resident(self) -> dict[int, int]:
        """{expert: slot} of filled slots (fills in flight included)."""
        return self.slot_table.resident()

    def _place(self, wanted: list[int], protected: set[int], source: str) -> list[Ticket]:
        return self.slot_table.place(wanted, protected, source)

    def _settle(self, tickets: list[Ticket]) -> None:
        self.slot_table.settle(tickets)

    def _all_published(self, experts) -> list[int] | None:
        return self.slot_table.all_published(experts)

    # ------------------------------------------------------------ ahead (prerouter) side

    def stage(self, experts) -> None:
        """Queue the expert set of a future single-token call and start reading the missing
        ones now, into slots that no queued or in-flight call uses. Does not block."""
        experts = sorted({int(e) for e in experts})
        where = self.resident()
        protected = {where[e] for staged in self.queue for e in staged if e in where}
        if self.points.overlapping:  # the last call's step may still be computing
            protected |= self.in_use
        self._place(experts, protected, source=PREFETCH)
        self.queue.append(experts)

    def predicted(self, x: mx.array, inds: mx.array, early: bool = False) -> mx.array:
        """A single-token call whose ids a prerouter predicted during the previous call (they
        ARE its routing: nothing to verify). Inside the decode loop the staging is a wait-only
        fill point: when the loop starts evaluating this call, its ids come to the host (one
        flush per step: the previous call made them all at its end) and the missing experts
        start reading into slots the previous call does not use; they are waited for and
        published just before the evaluation is queued past this layer (engine.fill_points).
        Elsewhere it is done now.
        `early` (same-token lead, engine.layer_lead): the ids were predicted from the previous
        layer's state of this same token, so they are ready only when this step's compute
        reaches that layer; the reads start when the previous layer's fill point is resolved
        and the fill waits for them in layer order (not a wait-only point)."""
        try:
            if self.queue:
                raise StagingError(f"layer {self.layer}: a predicted call while sets are "
                                   "staged by another driver")
            if self.points.active:
                issued: list[list[Ticket]] = []

                def start(_inds: mx.array) -> None:
                    issued.append(self._stage_predicted(inds))

                def settle(_inds: mx.array) -> None:
                    self._settle(issued.pop() if issued else self._stage_predicted(inds))
                fill = FillPoint(settle, start=start, wait_only=not early, early=early)
            else:
                fill = None
                self._settle(self._stage_predicted(inds))
        except BaseException:
            self.reset()
            raise
        return self._gather(x, inds, fill)

    def _stage_predicted(self, inds: mx.array) -> list[Ticket]:
        """Give the predicted experts slots the previous call does not use; start reading the
        missing ones. Returns the tickets to settle before this call's gather runs."""
        experts = sorted(set(np.array(inds).ravel().tolist()))
        slots = self._all_published(experts)
        if slots is not None:  # usual on a warm step: nothing to read
            self.in_use = set(slots)  # the next call's fill must keep these
            return []
        tickets = self._place(experts, self.in_use, source=PREFETCH)
        where = self.resident()
        self.in_use = {where[e] for e in experts}
        return tickets

    def verify(self) -> None:
        """Check that every routed expert of the calls since the last verify was staged (the
        routed ids are evaluated by now: no pipeline break; while the loop overlaps steps the
        last call's check waits for the next verify). Raises StagingError otherwise."""
        checks, self.checks = self.checks, []
        if self.points.overlapping and checks:
            checks, self.checks = checks[:-1], checks[-1:]
        for inds, staged in checks:
            lost = sorted(set(np.array(inds).ravel().tolist()) - set(staged))
            if lost:
                raise StagingError(f"layer {self.layer}: routed experts {lost} were not "
                                   f"staged (staged {staged}): output would be wrong")

    def reset(self) -> None:
        """Forget queued sets and settle reads in flight (after a failed request), so the
        path is consistent for the next request."""
        self.queue.clear()
        self.checks.clear()
        self.in_use = set()
        self.slot_table.settle_all()

    # ------------------------------------------------------------ the call

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        tokens = inds.size // inds.shape[-1]
        fill = None  # with a fill point: the host work it defers
        try:
            if tokens == 1 and self.points.active:  # fill the step being evaluated meanwhile
                self.points.progress()
            if self.queue and tokens == 1:
                staged = self.queue.popleft()
                where = self.resident()
                slots = [where[e] for e in staged]
                self.in_use = set(slots)
                in_flight = self.slot_table.ticket_of
                tickets = [in_flight[s] for s in slots if s in in_flight]
                self.checks.append((inds, staged))
                if self.points.active and any(not t.done() for t in tickets):
                    fill = FillPoint(lambda _inds: self._settle(tickets))
                else:  # landed already (staged a step or more ahead): nothing to wait for
                    self._settle(tickets)
            else:
                if self.queue:
                    raise StagingError(f"layer {self.layer}: a {tokens}-token call while sets "
                                       "are staged for single-token calls")
                if tokens == 1 and self.points.active:  # <= K experts: always fits the slots
                    fill = FillPoint(self._fill_routed)
                else:
                    experts = sorted(set(host_routed(inds, self.stats).ravel().tolist()))
                    if len(experts) > self.slots:
                        self.stats.exact_fallbacks += 1
                        self.stats.cache_misses += len(experts)
                        return self.exact(x, inds)
                    self._settle(self._place(experts, set(), source=DEMAND))
        except BaseException:
            self.reset()
            raise
        return self._gather(x, inds, fill)

    def _gather(self, x: mx.array, inds: mx.array, fill: FillPoint | None) -> mx.array:
        """The experts through the slot table; with `fill`, registered as its fill point."""
        out = switch_glu(x, self.slot_table.arrays, self.slot_table.slot_ids(inds), self.quant)
        if fill is not None:
            self._defer(inds, fill, out)
        return out

    def _fill_routed(self, inds: mx.array) -> None:
        """Fill point of an on-demand call: the router's ids to the host, missing experts
        read into free slots and published in the table. It runs while the compute thread
        waits, so the usual case (every routed expert already published in a slot: nothing
        to read) takes a short path."""
        experts = set(host_routed(inds, self.stats, deferred=True).ravel().tolist())
        if self._all_published(experts) is None:
            self._settle(self._place(sorted(experts), set(), source=DEMAND))

    def _defer(self, inds: mx.array, point: FillPoint, out: mx.array) -> None:
        """Register `point` as a fill point (its loads labelled with this call's step); a
        failure of its fill or start resets the path."""
        def resetting(fn):
            def run(i: mx.array) -> None:
                try:
                    fn(i)
                except BaseException:
                    self.reset()
                    raise
            return run

        point.fill = resetting(point.fill)
        if point.start is not None:
            point.start = resetting(point.start)
        self.points.defer(point, inds, out)
