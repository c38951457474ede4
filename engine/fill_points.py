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
token). Points whose ids a prerouter predicted a token ahead wait on nothing the step
computes: their reads start in `begin`, and each is resolved in its turn like the others.
Why this order, measured on the tiny model (reports/bench, reports/io/warm-a): MLX's
`async_eval` on CPU returns only once a few dozen operations remain queued, so a step cannot
be queued whole; a
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
from dataclasses import dataclass

import mlx.core as mx

from engine.step_clock import StepClock

Fill = Callable[[mx.array], None]
PHASES = ("start_next", "fill", "gather", "kick")  # the parts of FillPoints.progress, in order


@dataclass
class FillPoint:
    """Host work part of a step's graph waits on. `fill(inds)` brings the routed ids to the
    host and does the work (reads, slot table); `defer` fills in the rest."""

    fill: Fill
    start: Fill | None = None  # issues the reads ahead of `fill` (see FillPoints.begin)
    issue: Fill | None = None  # a routed point's reads, started by begin when it resolves it
    wait_only: bool = False  # needs nothing this step computes (ids predicted a step ahead)
    early: bool = False  # same-token lead: `start` runs once the previous point resolves
    inds: mx.array | None = None  # the routed ids it waits on
    gather: mx.array | None = None  # the layer's output that waits on it
    layer_input: mx.array | None = None  # an `early` point's layer input (see _kick)
    step: int = -1  # the step that registered it: its loads carry this step
    # reads to start as soon as the step's input token is on the host, before the router
    # (engine.first_layer_hint): `hint(token_id)`; `token` is that input, lazy at build
    hint: Callable[[int], None] | None = None
    token: mx.array | None = None


class FillPoints:
    def __init__(self, clock: StepClock | None = None) -> None:
        self.clock = clock if clock is not None else StepClock()
        self.active = False
        # True while the previous step may still be computing (the loop builds the next step
        # meanwhile): slots that step reads must not be rewritten.
        self.overlapping = False
        self.pending: list[FillPoint] = []  # registered by the step being built
        self.tokens: mx.array | None = None  # the input of the step being built (hints)
        self.backlog: deque[FillPoint] = deque()  # the step being evaluated: not yet resolved
        self.final: mx.array | None = None  # what to evaluate once the backlog is empty
        # [start, end) ns of progress() calls: step t's fills and the queueing of its next
        # piece, not step t+1's graph building. Queueing is waiting on compute: MLX's
        # async_eval on CPU blocks until only a few dozen operations remain queued.
        self.busy: list[tuple[int, int]] = []
        # ns spent in each part of progress() since the engine opened, and how many calls:
        # where a step's evaluation time goes, layer by layer (reports/validation's lead
        # probe). "start_next": a same-token lead's next ids to the host and its reads queued;
        # "fill": the head point's fill (reads waited for); "gather": handing its gather over;
        # "kick": handing over the walk to the next router (async_eval blocks until little
        # is left queued, so this is mostly waiting on compute).
        self.phase_ns: dict[str, int] = dict.fromkeys(PHASES, 0)
        self.phase_calls = 0

    @contextmanager
    def collecting(self) -> Iterator[FillPoints]:
        """Paths called inside defer their host work here instead of syncing at build."""
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def defer(self, point: FillPoint, inds: mx.array, gather: mx.array | None = None,
              layer_input: mx.array | None = None) -> None:
        """Register `point` for the routed ids `inds` at the clock's step. `gather`: the
        layer's output that waits on this fill; queued for evaluation right after it, on its
        own, so the compute thread restarts before the (longer) walk of the graph up to the
        next router. `layer_input`: the state the gather runs on (kept for `early` points)."""
        point.inds, point.gather, point.step = inds, gather, self.clock.step
        point.layer_input = layer_input if point.early else None
        self.pending.append(point)

    def take(self) -> list[FillPoint]:
        """The points registered since the last take (one forward step's), in layer order."""
        points, self.pending = self.pending, []
        return points

    def begin(self, points: list[FillPoint], final: mx.array | None) -> None:
        """Start evaluating a step: its points to resolve in order, then `final`.

        A point with a `hint` (the first MoE layer's, engine.first_layer_hint) starts its
        reads here, from the step's input token, which the sync below brings to the host with
        the predicted ids (the previous step's token and heads are one evaluation), before
        the predicted layers' reads, since its layer runs first.

        Wait-only points (`wait_only`: they need nothing this step computes, e.g. staging a
        layer whose ids a prerouter predicted during the previous step) never stop the
        compute thread: their `start` (issuing the reads) runs here, and each one's fill
        (waiting for its reads, publishing the slots) runs in its turn like any point's, just
        before its gather is queued, so the step is handed over layer by layer while the next
        step is built beside it, and no layer waits for a later layer's reads.

        When every point after the head is wait-only (a prerouter's token lead: the first MoE
        layer routes itself, the others were predicted), the head is the step's only wait on
        its own compute, and it is resolved here: its router's ids come to the host in the
        same sync as the predictions, its reads are issued first (its layer runs first), then
        the predicted layers', and only then are the head and the first wait-only point
        resolved (their reads waited for, their gathers queued). The evaluation then runs a
        layer ahead of the next step's build, where resolving the head at the next step's
        first layer left the compute thread idle while the host finished this token and built
        that layer (reports/io/lead-by-layer)."""
        self.backlog = deque(points)
        self.final = final
        early = bool(points) and not points[0].wait_only
        if early:
            self._kick()
        head_now = early and not points[0].early and all(p.wait_only for p in points[1:])
        starts = [p for p in points if p.start is not None and not p.early]
        hints = [p for p in points if p.hint is not None and p.token is not None]
        ids = [p.inds for p in starts] + [p.token for p in hints]
        if head_now:
            ids.append(points[0].inds)
        if ids:  # to the host in one sync: each sync is a round trip
            mx.eval(ids)
        for point in hints:  # first: its layer is the first to need them
            self._at_step(lambda _inds, p=point: p.hint(int(p.token.item())), point)
        if head_now and points[0].issue is not None:
            self._at_step(points[0].issue, points[0])
        for point in starts:
            self._at_step(point.start, point)
        if head_now:
            self._resolve_head()
        if (head_now or not early) and self.backlog:
            self._resolve_head()

    def progress(self) -> None:
        """Resolve the next point of the step being evaluated, if any: paths call this as
        they build the next step's graph, so layer l of step t is filled while layer l of
        step t+1 is built."""
        if not self.backlog:
            return
        t0 = time.perf_counter_ns()
        try:
            self._resolve_head(self.phase_ns)
            self.phase_calls += 1
        finally:
            self.busy.append((t0, time.perf_counter_ns()))

    def _resolve_head(self, phase: dict[str, int] | None = None) -> None:
        """Resolve the head point: its fill, then its gather queued on its own (compute
        restarts before the longer walk to the next router), then that walk. `phase`: where
        each part's ns go (progress's `phase_ns`)."""
        t0 = time.perf_counter_ns()
        point = self._pop()
        t1 = time.perf_counter_ns()
        self._at_step(point.fill, point)
        t2 = time.perf_counter_ns()
        if point.gather is not None:
            mx.async_eval(point.gather)
        t3 = time.perf_counter_ns()
        self._kick()
        if phase is not None:
            t4 = time.perf_counter_ns()
            phase["start_next"] += t1 - t0
            phase["fill"] += t2 - t1
            phase["gather"] += t3 - t2
            phase["kick"] += t4 - t3

    def _pop(self) -> FillPoint:
        """The head point; when the point after it is `early` (a same-token, one-layer lead:
        engine.layer_lead), that point's `start` runs first: its ids are ready when the head
        layer's are, so its reads overlap the head layer's fill and expert compute."""
        point = self.backlog.popleft()
        nxt = self.backlog[0] if self.backlog else None
        if nxt is not None and nxt.early and nxt.start is not None:
            self._at_step(nxt.start, nxt)
        return point

    def _at_step(self, fn: Fill, point: FillPoint) -> None:
        """`fn(point.inds)` at the point's step (its loads carry the step that registered it,
        though it runs while a later step is built)."""
        try:
            with self.clock.at(point.step):
                fn(point.inds)
        except BaseException:
            self.backlog.clear()
            raise

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
        """Queue the evaluation up to the next point's router (or the step's result). When
        the point after it is `early` (same-token lead), up to that point's ids too: they were
        predicted from the next point's layer input, which needs nothing the next fill
        writes, so that layer's attention runs while the host fills, instead of at the
        next `progress` when the host asks for the ids. An `early` point's own ids need
        nothing of its layer (they came from the layer before), so its layer input is queued
        too: else the last predicted layer of a step, with no point after it, would have its
        attention handed over only with its gather, after its fill, while compute idles."""
        head = self.backlog[0] if self.backlog else None
        if head is not None and head.wait_only:
            return  # its ids are on the host already; its gather is queued when resolved
        nxt = [head.inds] if head is not None else [self.final]
        if head is not None and head.layer_input is not None:
            nxt.append(head.layer_input)
        if len(self.backlog) > 1 and self.backlog[1].early:
            nxt.append(self.backlog[1].inds)
        nxt = [a for a in nxt if a is not None]
        if nxt:
            mx.async_eval(nxt)
        if not self.backlog:
            self.final = None


def resolve(points: list[FillPoint], clock: StepClock | None = None) -> None:
    """Resolve a step's points in order, nothing interleaved (prefill chunks)."""
    fills = FillPoints(clock)
    fills.begin(points, None)
    fills.drain()
