"""How much of a validation run's decode error the noise of its measured side can explain.

Each held-out configuration's rounds are drawn again with replacement (the bootstrap) and their
median decode tok/s taken, as validation.matrix_run takes it, once per draw; every configuration is
redrawn in every draw, so each draw gives one median and one p90 over the configurations:
  floor       |error| of a prediction equal to each configuration's observed median against
              the redrawn medians: what the rounds' noise alone makes of the summary figures,
              for a simulator that had every configuration's median exactly
  simulated   |error| of the run's simulated decode tok/s against the redrawn medians: how
              far this run's summary figures could move with the same rounds drawn again
The calibration configurations' rounds are not redrawn (that needs a refit and a replay per
draw), so the floor leaves out the noise the fit carries into every prediction: it is a lower
bound. Seeded: a report is the same each time it is written. No MLX here."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

DRAWS = 4000
SEED = 0


def median_draws(speeds: list[float], draws: int, rng: np.random.Generator) -> np.ndarray:
    """The median of `draws` resamples of `speeds`, each as many as there are rounds."""
    x = np.asarray(speeds, dtype=np.float64)
    return np.median(rng.choice(x, size=(draws, x.size)), axis=1)


def _summary(ape: np.ndarray) -> dict[str, Any]:
    """ape: configurations x draws. The median and p90 over configurations, per draw; their
    medians over the draws and the draws' 5-95% range."""
    med, p90 = np.median(ape, axis=0), np.percentile(ape, 90, axis=0)
    return {"median_pct": float(np.median(med)), "p90_pct": float(np.median(p90)),
            "median_range_pct": [float(v) for v in np.percentile(med, [5, 95])],
            "p90_range_pct": [float(v) for v in np.percentile(p90, [5, 95])]}


def noise_summary(results: list[dict], draws: int = DRAWS, seed: int = SEED) -> dict[str, Any]:
    """The floor and the simulated decode errors over `draws` redraws of the held-out
    configurations' rounds (module doc); empty without two configurations of two rounds."""
    held = [r for r in results if r["config"]["role"] == "held-out"
            and len([v for v in r.get("rounds_decode_tok_s") or [] if v]) >= 2
            and r["simulated"].get("decode_tok_s") is not None]
    if len(held) < 2:
        return {}
    rng = np.random.default_rng(seed)
    floor, simulated = [], []
    for r in held:
        speeds = [v for v in r["rounds_decode_tok_s"] if v]
        redrawn = median_draws(speeds, draws, rng)
        observed = statistics.median(speeds)
        floor.append(np.abs(redrawn - observed) / redrawn * 100.0)
        simulated.append(np.abs(r["simulated"]["decode_tok_s"] - redrawn) / redrawn * 100.0)
    return {"n": len(held), "draws": draws, "seed": seed,
            "floor": _summary(np.array(floor)), "simulated": _summary(np.array(simulated))}
