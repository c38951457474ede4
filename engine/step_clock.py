"""The forward step a load belongs to. The decode loop (engine.generate) sets it as it builds
and evaluates each step; readers stamp every ticket with it when a read is asked for, the exact
path passes it with its reads, and a fill point resolved during a later step's build runs at the
step that registered it (`at`). The store takes the step with each read and holds none."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class StepClock:
    def __init__(self) -> None:
        self.step = -1  # no step (loads outside a generation loop)

    @contextmanager
    def at(self, step: int) -> Iterator[None]:
        """Within: loads are labelled `step` (then back to the current one)."""
        now, self.step = self.step, step
        try:
            yield
        finally:
            self.step = now
