"""Is a trace's decode routing realistic? Compare its adjacent-token expert overlap with the
model's held-out, teacher-forced figure (the fixture build measures it: `fixture.json`
heldout.adjacent_overlap_mean, copied into the converted model by `convert`).

Greedy decoding of the tiny fixtures loops: overlap 0.66-0.88 against ~0.16-0.18 held out, so
every cache hits and the trace says nothing about caches, prefetch or storage. A trace whose
decode overlap exceeds the held-out figure by more than `MARGIN` is flagged. No MLX here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module's constants: keep it light (no polars)
    from traces.reader import Trace

MARGIN = 0.10  # realistic captures land within +-0.05 of the held-out figure
# The decode sampling `capture`, `bench` and `validate` use by default: temperature 1 with a
# fixed seed routes like held-out text and is reproducible (reports/routing-regime/).
DECODE_TEMP = 1.0
DECODE_SEED = 0


def decode_routing(temp: float, seed: int) -> dict:
    """How decode tokens were chosen (run.json `capture.decode_routing`, bench JSON), so a
    reader knows the routing regime of a trace."""
    if temp == 0:
        return {"mode": "greedy", "temp": 0.0, "seed": None}
    return {"mode": "sampled", "temp": float(temp), "seed": int(seed)}


@dataclass(frozen=True)
class Regime:
    decode_overlap: float | None
    heldout_overlap: float | None
    source: str | None  # where the held-out figure came from

    @property
    def repetitive(self) -> bool:
        return (self.decode_overlap is not None and self.heldout_overlap is not None
                and self.decode_overlap > self.heldout_overlap + MARGIN)

    def warning(self) -> str | None:
        if not self.repetitive:
            return None
        return (f"decode routing repeats: adjacent-token overlap {self.decode_overlap:.2f} vs "
                f"{self.heldout_overlap:.2f} on held-out text ({self.source}); caches hit far "
                "more than on real text, so this trace is no evidence for cache, prefetch or "
                "storage claims (capture with sampling: the default --temp 1.0)")


def heldout_overlap(model_dir: str | Path | None) -> tuple[float | None, str | None]:
    """The model's held-out adjacent overlap from its fixture.json, if it has one."""
    if not model_dir:
        return None, None
    f = Path(model_dir) / "fixture.json"
    try:
        value = json.loads(f.read_text())["heldout"]["adjacent_overlap_mean"]
        return float(value), str(f)
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def regime(trace: Trace, decode_overlap: float | None) -> Regime:
    held, source = heldout_overlap((trace.run.get("model") or {}).get("path"))
    return Regime(decode_overlap, held, source)
