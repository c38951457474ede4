"""How the staged path's slots get filled: three small strategies over one slot table
(engine.paths.slot_table), one per way the routing becomes known.

- `DemandFill` (no prerouter): the router's ids come to the host, the missing experts are read
  into free slots and waited for, then the gather runs. The sync is the honest price of not
  knowing the routing ahead. Inside the decode loop it is a fill point that the loop resolves
  during evaluation, after the whole step's graph is built (engine.fill_points); anywhere else
  it syncs at build time (`host_routed`), counted and timed either way.
- `AheadFill` (`stage(experts)`, driven by `RoutingReplay` or any driver that knows the next
  call's experts): they are read while the current step computes; the call then waits only for
  reads still in flight and does NOT sync. The staged set is checked against the router's
  actual ids after the step (`verify`, on already evaluated arrays); a routed expert that was
  not staged raises, it is never silently dropped.
- `PredictedFill` (a prerouter, engine.prerouter): the ids were predicted during the previous
  call and ARE the routing, so staged and routed sets are one; the staging is a wait-only fill
  point that the loop resolves as it starts the step, without stopping the compute thread.

Double buffering: new experts are only written into slots that no queued or in-flight call
uses. The last call's slots (`SlotTable.last_call`) count as in flight until the next call:
with the loop's lookahead, step t+1 is staged while step t may still compute."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.fill_points import FillPoint, FillPoints
from engine.first_layer_hint import FirstLayerHint
from engine.paths.slot_table import SlotTable, StagingError
from engine.paths.stats import PathStats, host_routed
from engine.readers import Ticket
from traces.schema import DEMAND, PREFETCH


class DemandFill:
    def __init__(self, table: SlotTable, stats: PathStats):
        self.table, self.stats = table, stats
        # (ids, tickets) of the reads `issue` started for the fill still to come
        self.issued: tuple[mx.array, list[Ticket]] | None = None

    def point(self, hint: FirstLayerHint | None = None, token: mx.array | None = None,
              report: Callable[[list[int]], None] | None = None) -> FillPoint:
        """A single-token call inside the decode loop (<= K experts: always fits the slots).
        With `hint`, the experts its table gives for `token` (the call's input token) start
        reading when the token is on the host (engine.first_layer_hint); `report` is told
        which."""
        if hint is None or token is None:
            return FillPoint(self.fill, issue=self.issue)

        def start_hinted(token_id: int) -> None:
            experts = hint.experts(token_id)
            if report is not None:
                report(experts)
            self.table.hint(experts)
        return FillPoint(self.fill, issue=self.issue, hint=start_hinted, token=token)

    def issue(self, inds: mx.array) -> None:
        """Start reading the routed experts that are missing, without waiting: the decode
        loop does this for a fill point it resolves as the step begins (a token lead's routed
        head, engine.fill_points.begin), so that its reads go ahead of the predicted layers'
        and those start before anything is waited for."""
        self.issued = (inds, self._place(inds))

    def fill(self, inds: mx.array) -> None:
        """The fill point: the router's ids to the host, missing experts read into free slots
        and published (or the reads `issue` started waited for). It runs while the compute
        thread waits, so the usual case (every routed expert already published: nothing to
        read) takes a short path."""
        issued, self.issued = self.issued, None
        tickets = issued[1] if issued is not None and issued[0] is inds else self._place(inds)
        if tickets:
            self.table.settle(tickets)
        self.table.reap()  # hinted reads the router did not pick, once they land

    def _place(self, inds: mx.array) -> list[Ticket]:
        """Slots for the routed experts; the tickets of the missing ones' reads."""
        experts = set(host_routed(inds, self.stats, deferred=True).ravel().tolist())
        if self.table.all_published(experts) is None:
            return self.table.place(sorted(experts), set(), source=DEMAND)
        return []

    def fill_now(self, inds: mx.array) -> bool:
        """Outside the decode loop: sync at build and fill. False (counted as a fallback) when
        the call's distinct experts exceed the slots: the caller runs the exact path."""
        experts = sorted(set(host_routed(inds, self.stats).ravel().tolist()))
        if len(experts) > self.table.slots:
            self.stats.exact_fallbacks += 1
            self.stats.cache_misses += len(experts)
            return False
        self.table.settle(self.table.place(experts, set(), source=DEMAND))
        return True


class AheadFill:
    def __init__(self, table: SlotTable, layer: int, points: FillPoints):
        self.table, self.layer, self.points = table, layer, points
        self.queue: deque[list[int]] = deque()  # staged sets (sorted ids), one per future call
        self.checks: list[tuple[mx.array, list[int]]] = []  # (routed ids, staged set)

    def stage(self, experts) -> None:
        """Queue the expert set of a future single-token call and start reading the missing
        ones now, into slots that no queued or in-flight call uses. Does not block."""
        experts = sorted({int(e) for e in experts})
        where = self.table.resident()
        protected = {where[e] for staged in self.queue for e in staged if e in where}
        if self.points.overlapping:  # the last call's step may still be computing
            protected |= self.table.last_call
        self.table.place(experts, protected, source=PREFETCH)
        self.queue.append(experts)

    def take(self, inds: mx.array) -> FillPoint | None:
        """The call the oldest staged set is for: its slots, waited for now or (inside the
        loop, reads still in flight) at a fill point; the routed ids are checked later."""
        staged = self.queue.popleft()
        where = self.table.resident()
        slots = [where[e] for e in staged]
        self.table.last_call = set(slots)
        in_flight = self.table.ticket_of
        tickets = [in_flight[s] for s in slots if s in in_flight]
        self.checks.append((inds, staged))
        if self.points.active and any(not t.done() for t in tickets):
            return FillPoint(lambda _inds: self.table.settle(tickets))
        self.table.settle(tickets)  # landed already (staged a step or more ahead)
        return None

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
        self.queue.clear()
        self.checks.clear()


class PredictedFill:
    def __init__(self, table: SlotTable, points: FillPoints):
        self.table, self.points = table, points

    def take(self, inds: mx.array, early: bool) -> FillPoint | None:
        """Inside the decode loop, a wait-only fill point: when the loop starts evaluating this
        call, its ids come to the host (one flush per step: the previous call made them all at
        its end) and the missing experts start reading into slots the previous call does not
        use; they are waited for just before the evaluation is queued past this layer.
        Elsewhere it is done now.
        `early` (same-token lead, engine.layer_lead): the ids were predicted from the previous
        layer's state of this same token, so they are ready only when this step's compute
        reaches that layer; the reads start when the previous layer's fill point is resolved
        and the fill waits for them in layer order (not a wait-only point)."""
        if not self.points.active:
            self.table.settle(self.stage(inds))
            return None
        issued: list[list[Ticket]] = []

        def start(_inds: mx.array) -> None:
            issued.append(self.stage(inds))

        def settle(_inds: mx.array) -> None:
            self.table.settle(issued.pop() if issued else self.stage(inds))
        return FillPoint(settle, start=start, wait_only=not early, early=early)

    def stage(self, inds: mx.array) -> list[Ticket]:
        """Give the predicted experts slots the previous call does not use; start reading the
        missing ones. Returns the tickets to settle before this call's gather runs."""
        table = self.table
        experts = sorted(set(np.array(inds).ravel().tolist()))
        slots = table.all_published(experts)
        if slots is not None:  # usual on a warm step: nothing to read
            table.last_call = set(slots)  # the next call's fill must keep these
            return []
        tickets = table.place(experts, table.last_call, source=PREFETCH)
        where = table.resident()
        table.last_call = {where[e] for e in experts}
        return tickets
