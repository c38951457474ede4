"""The staged path, the decode workhorse: per layer a fixed stack of S = K + headroom slots,
preallocated once. A slot table (an MLX uint32 array [E], expert id -> slot) maps routed ids
to slots on the device with `take`, so the gather never needs the ids on the host. Experts
that stay routed keep their slot ("sticky"); only changed slots are rewritten, in place, by
reader threads doing `os.preadv` straight into the slot rows (the paper's incr_stack without
its main-thread copy). The slots and their table are engine.paths.slot_table's; this module
is how they get filled.

Three ways the slots get filled, each a small strategy of engine.paths.staged_fill: on demand
(`DemandFill`: the router's ids to the host, the missing experts read and waited for), staged
ahead and verified after (`AheadFill`: `stage(experts)`, `verify()`), and predicted
(`PredictedFill`: a prerouter's ids, which ARE the routing). Inside the decode loop
(`FillPoints.collecting`) each only builds the gather and registers a fill point that the loop
resolves during evaluation (engine.fill_points).

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

from collections.abc import Callable

import mlx.core as mx

from contract import eviction
from engine.fill_points import FillPoint, FillPoints
from engine.first_layer_hint import FirstLayerHint
from engine.paths.exact import ExactPath
from engine.paths.kernel import ExpertPath, Quant, switch_glu
from engine.paths.slot_table import SlotTable, StagingError
from engine.paths.staged_fill import AheadFill, DemandFill, PredictedFill
from engine.paths.stats import PathStats
from engine.readers import ReaderPool
from engine.store import ExpertStore


class StagedPath(ExpertPath):
    name = "staged"
    takes_predicted = True

    def __init__(self, store: ExpertStore, layer: int, readers: ReaderPool, stats: PathStats,
                 headroom: int | None = None, points: FillPoints | None = None,
                 policy: str = eviction.DEFAULT):
        self.store, self.layer, self.readers, self.stats = store, layer, readers, stats
        self.points = points if points is not None else FillPoints()
        self.k = store.manifest.top_k
        self.headroom = self.k if headroom is None else int(headroom)
        if self.headroom < 0:
            raise ValueError(f"staged headroom must be >= 0, got {self.headroom}")
        self.quant = Quant.of(store.manifest)
        self.slot_table = SlotTable(store, layer, readers, stats, self.k, self.headroom, policy)
        self.demand_fill = DemandFill(self.slot_table, stats)
        self.ahead_fill = AheadFill(self.slot_table, layer, self.points)
        self.predicted_fill = PredictedFill(self.slot_table, self.points)
        self.exact = ExactPath(store, layer, step_clock=self.points.clock, stats=stats)
        # the first MoE layer's token table (engine.first_layer_hint), installed by the loader
        self.hint: FirstLayerHint | None = None
        # (step, layer, experts) of each hint as it starts: the recorder's (engine.recorder)
        self.on_hint: Callable[[int, int, list[int]], None] | None = None

    def _hinted(self, experts: list[int]) -> None:
        if self.on_hint is not None:
            self.on_hint(self.points.clock.step, self.layer, experts)

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

    def stage(self, experts) -> None:
        """Queue the expert set of a future single-token call and start reading it (AheadFill)."""
        self.ahead_fill.stage(experts)

    def verify(self) -> None:
        """Raise StagingError if a routed expert of the calls staged ahead was not staged."""
        self.ahead_fill.verify()

    def reset(self) -> None:
        """Forget queued sets and settle reads in flight (after a failed request), so the
        path is consistent for the next request."""
        self.ahead_fill.reset()
        self.demand_fill.issued = None
        self.slot_table.settle_all()

    def forget(self) -> None:
        self.reset()
        self.slot_table.forget()

    def predicted(self, x: mx.array, inds: mx.array, early: bool = False) -> mx.array:
        """A single-token call whose ids a prerouter predicted during the previous call (they
        ARE its routing: nothing to verify). See PredictedFill.take for `early`. Inside the
        decode loop it is built while the step before is evaluated, as a routed call is
        (`__call__`): it resolves that step's next fill point, so the step's fills keep pace
        with the build instead of waiting for the whole graph (engine.fill_points)."""
        try:
            if self.points.active:
                self.points.progress()
            if self.ahead_fill.queue:
                raise StagingError(f"layer {self.layer}: a predicted call while sets are "
                                   "staged by another driver")
            fill = self.predicted_fill.take(inds, early)
        except BaseException:
            self.reset()
            raise
        return self._gather(x, inds, fill)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        tokens = inds.size // inds.shape[-1]
        fill = None  # with a fill point: the host work it defers
        try:
            if tokens == 1 and self.points.active:  # fill the step being evaluated meanwhile
                self.points.progress()
            if self.ahead_fill.queue and tokens == 1:
                fill = self.ahead_fill.take(inds)
            elif self.ahead_fill.queue:
                raise StagingError(f"layer {self.layer}: a {tokens}-token call while sets "
                                   "are staged for single-token calls")
            elif tokens == 1 and self.points.active:
                fill = self.demand_fill.point(self.hint, self.points.tokens, self._hinted)
            elif not self.demand_fill.fill_now(inds):
                return self.exact(x, inds)
        except BaseException:
            self.reset()
            raise
        return self._gather(x, inds, fill)

    def _gather(self, x: mx.array, inds: mx.array, fill: FillPoint | None) -> mx.array:
        """The experts through the slot table; with `fill`, registered as its fill point."""
        out = switch_glu(x, self.slot_table.arrays, self.slot_table.slot_ids(inds), self.quant)
        if fill is not None:
            self._defer(inds, fill, out, x)
        return out

    def _defer(self, inds: mx.array, point: FillPoint, out: mx.array, x: mx.array) -> None:
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
        self.points.defer(point, inds, out, layer_input=x)
