"""The oracle (bench arm staged-oracle): a perfect stand-in for the prerouter
(engine.prerouter). `RoutingReplay` replays routing recorded from an earlier identical run and
stages each decode step's experts one token ahead."""

from __future__ import annotations

import numpy as np


class RoutingReplay:
    """One-token-ahead staging from recorded routing: an oracle standing in for the prerouter
    (same interface a prerouter will drive: `StagedPath.stage(experts)` for the next call).

    `record(model)` returns callbacks that capture each single-token step's routed experts per
    layer during a reference run; `driver(paths)` returns an `on_step_start` hook that, at the
    start of decode step s, makes sure step s is staged and stages step s+1 (read by reader
    threads while step s computes), and checks the previous step's routing was covered. With
    the decode loop's lookahead, step s starts (is built) while step s-1 computes, so the hook
    stages step s only: the reads still get a step's compute to land."""

    def __init__(self):
        self.routes: dict[tuple[int, int], list[int]] = {}  # (step, layer) -> experts
        self._step = -1
        self._tokens = 0

    def recorder(self):
        """(on_step_start, on_routing, finish) hooks for the reference run (step numbers must
        match the replay run's: same prompt, same generate arguments, greedy). The ids stay
        lazy until `finish()`: evaluating them in on_step_start could run a step whose fill
        points the decode loop has not resolved yet (engine.fill_points)."""
        pending: list[tuple[int, int, object]] = []

        def on_step_start(step: int, phase: str, tokens: int) -> None:
            self._step, self._tokens = step, tokens

        def on_routing(layer: int, inds, weights) -> None:
            if self._tokens == 1:
                pending.append((self._step, layer, inds))

        def finish() -> None:
            for step, layer, inds in pending:
                self.routes[(step, layer)] = sorted(set(np.array(inds).ravel().tolist()))
            pending.clear()

        return on_step_start, on_routing, finish

    def driver(self, paths: dict):
        """on_step_start hook driving `paths` ({layer: StagedPath}) one token ahead."""
        staged: set[tuple[int, int]] = set()

        def on_step_start(step: int, phase: str, tokens: int) -> None:
            for layer, path in paths.items():
                path.verify()
                if tokens != 1:
                    continue
                # With the loop's lookahead this hook runs while the previous step still
                # computes: staging `step` now already is one token ahead.
                # With headroom 2K there is room to stage step+1 as well (three sets: the one
                # computing, this one, the next), so reads get a whole step more.
                ahead = (step, step + 1)
                if path.points.overlapping and path.headroom < 2 * path.k:
                    ahead = (step,)
                for s in ahead:
                    key = (s, layer)
                    if key in self.routes and key not in staged:
                        path.stage(self.routes[key])
                        staged.add(key)

        return on_step_start
