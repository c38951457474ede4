"""Fill points: host work that a step's graph needs done before part of it may run, deferred
from graph building to evaluation.

A staged layer filled on demand must know its routed ids before its gather runs, and ids live
on the device. Syncing while the graph is being built (`np.array(inds)` inside the model call)
evaluates the graph up to that router and leaves the compute thread idle while Python builds
the rest of the layer: on the tiny model that costs a quarter of a step. Instead, while
`collecting()` is active, a path builds its whole graph (the gather reads the slot stack
through the slot table, both filled in place later) and registers a fill point `(inds, fill)`.
`fill(inds)` brings that router's ids to the host (evaluating only up to it), reads the
missing experts into their slots and publishes them in the table, and it runs before anything
downstream of that layer is evaluated.

The decode loop (engine.generate) queues a step's evaluation as soon as its graph is built
(`begin`: evaluation up to the first point's router), then builds the next step; as each
staged layer of the next step is built it resolves one point of the step being evaluated
(`progress`), and `drain` resolves what is left. After each fill the layer's gather is queued
on its own, then the walk up to the next router (after the last point, up to the step's
token). Why this order, measured on the tiny model (reports/bench): MLX's `async_eval` on CPU
returns only once a few dozen operations remain queued, so a step cannot be queued whole; a
fill that waits on the host stalls the compute thread for its host work and wake-up, and the
graph walk to the next router adds to that unless the gather goes first; building the next
step between fills keeps the main thread busy while the compute thread works through a layer,
instead of building it after the last fill while compute idles.

Correctness rests on MLX evaluating lazily: nothing downstream of layer l's router runs until
someone evaluates it, and nothing downstream is evaluated before `fill` returns. Outside
`collecting()` paths sync at build time as before, so a caller that evaluates the model itself
(tests, mlx-lm helpers) never sees an unfilled slot."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx

Fill = Callable[[mx.array], None]
Point = tuple[mx.array, Fill, "mx.array | None"]  # (routed ids, host work, the gather)


class FillPoints:
    def __init__(self) -> None:
        self.active = False
        # True while the previous step may still be computing (the loop builds the next step
        # meanwhile): slots that step reads must not be rewritten.
        self.overlapping = False
        self.pending: list[Point] = []  # registered by the step being built
        self.backlog: deque[Point] = deque()  # the step being evaluated: not yet resolved
        self.final: mx.array | None = None  # what to evaluate once the backlog is empty
        self.busy: list[tuple[int, int]] = []  # [start, end) ns of fills done by progress()

    @contextmanager
    def collecting(self) -> Iterator[FillPoints]:
        """Paths called inside defer their host work here instead of syncing at build."""
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def defer(self, inds: mx.array, fill: Fill, gather: mx.array | None = None) -> None:
        """`gather`: the layer's output that waits on this fill; queued for evaluation right
        after it, on its own, so the compute thread restarts before the (longer) walk of the
        graph up to the next router."""
        self.pending.append((inds, fill, gather))

    def take(self) -> list[Point]:
        """The points registered since the last take (one forward step's), in layer order."""
        points, self.pending = self.pending, []
        return points

    def begin(self, points: list[Point], final: mx.array | None) -> None:
        """Start evaluating a step: its points to resolve in order, then `final`.

        Wait-only points (a fill marked `wait_only`: it needs nothing this step computes,
        e.g. staging a layer whose ids a prerouter predicted during the previous step) never
        stop the compute thread: their `start` (issuing the reads) runs here, after the
        evaluation up to the first other point is queued, and their fill (waiting for the
        reads, publishing the slots) runs just before the evaluation is queued past them."""
        self.backlog = deque(points)
        self.final = final
        early = bool(points) and not _wait_only(points[0])
        if early:
            self._kick()
        for inds, fill, _ in points:
            start = getattr(fill, "start", None)
            if start is not None and not _early(fill):
                self._timed(start, inds)
        self._resolve_waits()
        if not early:
            self._kick()

    def progress(self) -> None:
        """Resolve the next point of the step being evaluated, if any: paths call this as
        they build the next step's graph, so layer l of step t is filled while layer l of
        step t+1 is built."""
        if not self.backlog:
            return
        inds, fill, gather = self._pop()
        self._timed(fill, inds)
        if gather is not None:  # restart compute before the longer walk to the next router
            mx.async_eval(gather)
        self._resolve_waits()
        self._kick()

    def _resolve_waits(self) -> None:
        """Resolve the wait-only points at the head of the backlog (see `begin`)."""
        while self.backlog and _wait_only(self.backlog[0]):
            inds, fill, _ = self._pop()
            self._timed(fill, inds)

    def _pop(self) -> Point:
        """The head point; when the point after it is `early` (a same-token, one-layer lead:
        engine.layer_lead), that point's `start` runs first: its ids are ready when the head
        layer's are, so its reads overlap the head layer's fill and expert compute."""
        point = self.backlog.popleft()
        if self.backlog and _early(self.backlog[0][1]):
            inds, fill, _ = self.backlog[0]
            self._timed(fill.start, inds)
        return point

    def _timed(self, fn: Fill, inds: mx.array) -> None:
        t0 = time.perf_counter_ns()
        try:
            fn(inds)
        except BaseException:
            self.backlog.clear()
            raise
        finally:
            self.busy.append((t0, time.perf_counter_ns()))

    def drain(self) -> None:
        """Resolve the remaining points of the step being evaluated, in order."""
        while self.backlog:
            self.progress()

    def abort(self) -> None:
        """Forget everything (a failed request)."""
        self.pending.clear()
        self.backlog.clear()
        self.final = None
        self.overlapping = False

    def _kick(self) -> None:
        """Queue the evaluation up to the next point's router (or the step's result)."""
        nxt = self.backlog[0][0] if self.backlog else self.final
        if nxt is not None:
            mx.async_eval(nxt)
        if not self.backlog:
            self.final = None


def _wait_only(point: Point) -> bool:
    return getattr(point[1], "wait_only", False)


def _early(fill: Fill) -> bool:
    return getattr(fill, "early", False) and getattr(fill, "start", None) is not None


def at_build_step(store, fill: Fill) -> Fill:
    """`fill` run with `store.step` set back to the step being built now, so the load rows
    of a fill resolved during a later step's build carry the step that consumes them."""
    step = store.step

    def run(inds: mx.array) -> None:
        now, store.step = store.step, step
        try:
            fill(inds)
        finally:
            store.step = now

    run.wait_only = getattr(fill, "wait_only", False)
    run.early = getattr(fill, "early", False)
    start = getattr(fill, "start", None)
    if start is not None:
        run.start = at_build_step(store, start)
    return run


def resolve(points: list[Point]) -> None:
    """Resolve a step's points in order, nothing interleaved (prefill chunks)."""
    fills = FillPoints()
    fills.begin(points, None)
    fills.drain()
