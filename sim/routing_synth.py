"""Synthetic decode routing at paper scale, from a few parameters (no MLX, numpy only).

Model, per layer, one Markov chain over K-sets of distinct experts:
  - popularity: expert loads follow Zipf(skew) over a per-layer random ranking of the experts
    (skew 0 = uniform). As an inclusion probability pi_i = K * p_i it is capped at
    MAX_INCLUSION = 0.5 (water-filled: no expert is in more than half the tokens' sets; the
    excess goes to the others in proportion). `target_load` returns the resulting load shares
    pi / K, which the chain reproduces (KL at the sampling-noise floor). Why 0.5: with
    reuse r no chain can exceed 1 / (2 - r), and close to that the fresh draws below saturate
    and undershoot the hottest experts; up to 0.5 they never need to.
  - reuse: each expert of the previous token's set is kept independently with probability
    `reuse`; the missing slots are drawn from the experts NOT in the previous set (so the
    adjacent overlap |S_t & S_t-1| / K has expectation exactly `reuse`) with inclusion
    probabilities proportional to pi_i / (1 - pi_i) (what makes pi the stationary load),
    by systematic sampling in a random order (exact inclusion probabilities, distinct ids).
  - recall (multi-token reuse, 0 = off): a share `recall` of those fresh draws copies an
    expert from the sets of the last `window` tokens instead (in proportion to how often each
    appears there; never the previous set's). Real routing has it: a token's experts were
    used a few tokens back far more often than popularity alone gives (sim.routing_fit
    measures it as novelty). Copying by occurrence keeps loads near their popularity; the
    fitted skew absorbs what remains.
  - prediction: for each predicted (step, layer) the predicted set keeps each routed expert
    with probability `prediction_accuracy` and fills the rest with wrong experts drawn by
    popularity from outside the routed set (so |P & R| / K has expectation the accuracy).
The first set of each chain is drawn from pi itself, so there is no burn-in.

Encoding in a routing table (traces.schema.ROUTING_COLUMNS, decode steps, token 0, request 0):
one row per (step, layer), as the engine records it. A layer without prediction has
source="router" and experts = the routed set. A predicted layer has source="prediction",
experts = the predicted set (what a prerouter engine executes and stages), and
router_experts = the routed set. router_experts is filled on every row, so "the true routing"
is always router_experts and "the prediction" is experts where source == "prediction".
`routing_sets` turns such a table (or any trace's decode routing) back into dense arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from contract.errors import BadInput
from traces.reader import Trace
from traces.schema import (
    LOAD_COLUMNS,
    ROUTING_COLUMNS,
    ROUTING_FILE,
    SCHEMA_VERSION,
    STEP_COLUMNS,
)

# No expert is in more than this fraction of the tokens' sets (see module docstring).
MAX_INCLUSION = 0.5


@dataclass
class SynthRouting:
    layers: int = 40
    experts: int = 256
    k: int = 4
    steps: int = 1000  # decode steps (one token each)
    skew: float | Sequence[float] = 0.0  # Zipf exponent of expert popularity; one or per layer
    reuse: float = 0.25  # expected fraction of the previous token's set a token keeps
    # multi-token reuse: a share `recall` of the fresh draws copies an expert from the sets of
    # the last `window` tokens (by occurrence), the rest is drawn by popularity
    recall: float = 0.0
    window: int = 16
    prediction_accuracy: float | None = None  # None: no predicted sets
    predicted_layers: Sequence[int] | None = None  # None: every layer but 0 (it has no owner)
    seed: int = 0

    def skews(self) -> np.ndarray:
        if isinstance(self.skew, (int, float)):
            return np.full(self.layers, float(self.skew))
        skews = np.asarray(self.skew, dtype=np.float64)
        if skews.shape != (self.layers,):
            raise ValueError(f"skew: expected one value or {self.layers}, got {len(skews)}")
        return skews

    def predicted(self) -> np.ndarray:
        """Sorted layer ids that get a predicted set (empty without prediction_accuracy)."""
        if self.prediction_accuracy is None:
            return np.zeros(0, dtype=np.int64)
        if self.predicted_layers is None:
            return np.arange(1, self.layers)
        layers = np.unique(np.asarray(self.predicted_layers, dtype=np.int64))
        if len(layers) and (layers[0] < 0 or layers[-1] >= self.layers):
            raise ValueError(f"predicted_layers: ids must be in 0..{self.layers - 1}")
        return layers

    def validate(self) -> None:
        if self.layers < 1 or self.steps < 1:
            raise ValueError("layers and steps must be >= 1")
        if not 1 <= self.k <= self.experts // 2:
            raise ValueError(f"k={self.k}: need 1 <= k <= experts/2 ({self.experts // 2})")
        if not 0.0 <= self.reuse <= 1.0:
            raise ValueError(f"reuse={self.reuse}: must be in [0, 1]")
        if not 0.0 <= self.recall <= 1.0:
            raise ValueError(f"recall={self.recall}: must be in [0, 1]")
        if self.window < 1:
            raise ValueError(f"window={self.window}: must be >= 1 token")
        acc = self.prediction_accuracy
        if acc is not None and not 0.0 <= acc <= 1.0:
            raise ValueError(f"prediction_accuracy={acc}: must be in [0, 1]")
        if np.any(self.skews() < 0):
            raise ValueError("skew: must be >= 0")
        self.predicted()


@dataclass
class RoutingSets:
    """Dense routing, [steps, layers, K]; -1 = no data. Synthetic sets list ids ascending;
    sets read from a trace keep the trace's order."""

    router: np.ndarray  # int16, the routed (true) sets
    predicted: np.ndarray  # int16, the predicted sets; rows of -1 where a layer has none
    weights: np.ndarray  # float32, sums to 1 per set (synthetic: random placeholders)
    step: np.ndarray  # int64 [steps], the trace step of each position

    def predicted_layers(self) -> np.ndarray:
        return np.flatnonzero((self.predicted[:, :, 0] >= 0).any(axis=0))


def _waterfill(x: np.ndarray, total: np.ndarray, cap: float) -> np.ndarray:
    """Scale each row of x >= 0 to sum `total`, with no entry above `cap` (excess spread over
    the uncapped entries in proportion). Needs total <= cap * (nonzero entries)."""
    x = np.asarray(x, dtype=np.float64)
    total = np.asarray(total, dtype=np.float64).reshape(-1, 1)
    denom = x.sum(axis=1, keepdims=True)
    out = x * np.divide(total, denom, out=np.zeros_like(total), where=denom > 0)
    if out.max(initial=0.0) <= cap:  # the usual case: nothing to cap
        return out
    capped = np.zeros(x.shape, dtype=bool)
    for _ in range(x.shape[1]):
        free = np.where(capped, 0.0, x)
        room = total - cap * capped.sum(axis=1, keepdims=True)
        denom = free.sum(axis=1, keepdims=True)
        scale = np.divide(room, denom, out=np.zeros_like(room), where=denom > 0)
        out = np.where(capped, cap, free * scale)
        over = (out > cap) & ~capped
        if not over.any():
            return np.minimum(out, cap)
        capped |= over
    return np.minimum(out, cap)


def target_inclusion(params: SynthRouting) -> np.ndarray:
    """[layers, experts] probability that an expert is in a token's set (rows sum to K)."""
    params.validate()
    rng = np.random.default_rng([params.seed, 0])
    n, k = params.experts, params.k
    ranks = np.arange(1, n + 1, dtype=np.float64)
    rows = []
    for s in params.skews():
        p = ranks ** -s
        p = p[rng.permutation(n)]  # hot experts differ from layer to layer
        rows.append(p / p.sum() * k)
    cap = MAX_INCLUSION
    return _waterfill(np.stack(rows), np.full(params.layers, float(k)), cap)


def target_load(params: SynthRouting) -> np.ndarray:
    """[layers, experts] expected share of a layer's expert loads (rows sum to 1)."""
    return target_inclusion(params) / params.k


def _systematic(incl: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row by systematic sampling: a mask with exactly round(row sum) distinct
    experts, expert i included with probability incl[r, i] (<= 1). The expert order is a fresh
    random permutation per call, shared by the rows (rows are different layers, whose expert
    ids are unrelated, so only the per-row distribution matters) with an independent start u."""
    rows, n = incl.shape
    order = rng.permutation(n)
    # Work expert-major ([n, rows]): cumsum down axis 0 is vectorised across rows.
    cum = np.cumsum(incl.T[order], axis=0)
    cum[-1] = np.rint(cum[-1])
    u = 1.0 - rng.random(rows)  # (0, 1]
    hi = np.floor(cum - u)
    picked = np.empty((n, rows), dtype=bool)
    picked[0] = hi[0] > -1.0
    np.greater(hi[1:], hi[:-1], out=picked[1:])
    mask = np.empty((n, rows), dtype=bool)
    mask[order] = picked
    mask = mask.T
    # Guard against float edge cases (a zero-probability expert picked, a count off by one).
    want = np.rint(cum[-1]).astype(np.int64)
    bad = (mask.sum(axis=1) != want) | (mask & (incl <= 0)).any(axis=1)
    for r in np.flatnonzero(bad):  # ~never happens
        mask[r] = False
        mask[r, rng.choice(n, want[r], replace=False, p=incl[r] / incl[r].sum())] = True
    return mask


def _ids(mask: np.ndarray, k: int) -> np.ndarray:
    return np.nonzero(mask)[1].reshape(mask.shape[0], k)


def _keep(ids: np.ndarray, prob: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Mask of the ids kept, each independently with probability prob."""
    keep = rng.random(ids.shape) < prob
    mask = np.zeros((ids.shape[0], n), dtype=bool)
    rows = np.repeat(np.arange(ids.shape[0]), ids.shape[1])
    mask[rows[keep.ravel()], ids.ravel()[keep.ravel()]] = True
    return mask


def _recall_mix(fresh_share: np.ndarray, history: np.ndarray, current: np.ndarray,
                recall: float) -> np.ndarray:
    """Fresh-draw weights outside the current set: (1 - recall) x popularity + recall x the
    recent sets' occurrences (rows with no recent expert outside the set: popularity only)."""
    pop = np.where(current, 0.0, fresh_share)
    pop /= np.maximum(pop.sum(axis=1, keepdims=True), 1e-300)
    recent = np.where(current, 0.0, history)
    total = recent.sum(axis=1, keepdims=True)
    share = np.where(total > 0, recall, 0.0)
    return (1.0 - share) * pop + share * recent / np.maximum(total, 1e-300)


def generate_sets(params: SynthRouting) -> RoutingSets:
    """Routed and predicted sets, [steps, layers, K], deterministic per seed."""
    incl = target_inclusion(params)  # validates
    L, n, k, T = params.layers, params.experts, params.k, params.steps
    pred_layers = params.predicted()
    acc = params.prediction_accuracy or 0.0
    rng = np.random.default_rng([params.seed, 1])
    # Fresh draws for the excluded-previous-set chain: weights pi/(1-pi) give stationary pi.
    fresh_w = incl / np.maximum(1.0 - incl, 1e-12)
    router = np.empty((T, L, k), dtype=np.int16)
    predicted = np.full((T, L, k), -1, dtype=np.int16)
    fresh_share = fresh_w / fresh_w.sum(axis=1, keepdims=True)
    recall = params.recall
    history = np.zeros((L, n))  # occurrences in the last `window` sets (recall > 0)
    ring = np.zeros((params.window, L, n), dtype=bool)
    mask = _systematic(incl, rng)
    for t in range(T):
        ids = _ids(mask, k)
        router[t] = ids
        parts, totals, kept = [], [], []
        if t + 1 < T:
            kept_chain = _keep(ids, params.reuse, n, rng)
            if recall > 0:
                slot = t % params.window
                history += mask
                history -= ring[slot]
                ring[slot] = mask
                parts.append(_recall_mix(fresh_share, history, mask, recall))
            else:
                parts.append(np.where(mask, 0.0, fresh_w))
            totals.append(k - kept_chain.sum(axis=1))
            kept.append(kept_chain)
        if len(pred_layers):
            kept_pred = _keep(ids[pred_layers], acc, n, rng)
            parts.append(np.where(mask[pred_layers], 0.0, incl[pred_layers]))
            totals.append(k - kept_pred.sum(axis=1))
            kept.append(kept_pred)
        if not parts:
            break
        draw = _systematic(_waterfill(np.concatenate(parts), np.concatenate(totals), 1.0), rng)
        if t + 1 < T:
            mask = kept[0] | draw[:L]
        if len(pred_layers):
            predicted[t, pred_layers] = _ids(kept[-1] | draw[-len(pred_layers):], k)
    w = np.random.default_rng([params.seed, 2]).random((T, L, k)) + 0.05
    weights = (w / w.sum(axis=-1, keepdims=True)).astype(np.float32)
    return RoutingSets(router, predicted, weights, np.arange(T, dtype=np.int64))


def routing_frame(sets: RoutingSets) -> pl.DataFrame:
    """The sets as a routing table (ROUTING_COLUMNS), one row per (step, layer); see module."""
    T, L, k = sets.router.shape
    has_pred = (sets.predicted[..., 0] >= 0).reshape(-1)
    router = sets.router.reshape(-1, k)
    executed = np.where(has_pred[:, None], sets.predicted.reshape(-1, k), router)
    lists = pl.List(pl.Int16())
    return pl.DataFrame({
        "step": np.repeat(sets.step, L),
        "layer": np.tile(np.arange(L, dtype=np.int16), T),
        "token": np.zeros(T * L, dtype=np.int32),
        "experts": pl.Series(executed).cast(lists),
        "weights": pl.Series(sets.weights.reshape(-1, k)).cast(pl.List(pl.Float32())),
        "source": np.where(has_pred, "prediction", "router"),
        "router_experts": pl.Series(router).cast(lists),
        "hinted_experts": pl.Series([None] * (T * L), dtype=lists),
    }, schema=ROUTING_COLUMNS)


def synthetic_trace(params: SynthRouting, bundle_bytes: int, name: str = "synthetic",
                    sets: RoutingSets | None = None) -> Trace:
    """An in-memory Trace (kind "synthetic") holding the synthetic decode routing: steps have
    phase decode, 1 token, request 0 and null timings; loads is empty."""
    sets = sets if sets is not None else generate_sets(params)
    T = sets.router.shape[0]
    steps = pl.DataFrame({
        "step": sets.step, "request": np.zeros(T, dtype=np.int32),
        "phase": ["decode"] * T, "tokens": np.ones(T, dtype=np.int32),
    }).with_columns(
        pl.lit(None, dtype=dtype).alias(col) for col, dtype in STEP_COLUMNS.items()
        if col not in ("step", "request", "phase", "tokens")
    ).select(pl.col(c).cast(t) for c, t in STEP_COLUMNS.items())
    run: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "synthetic",
        "complete": True,
        "model": {"name": name, "architecture": "synthetic", "layers": params.layers,
                  "experts": params.experts, "k": params.k, "bundle_bytes": int(bundle_bytes)},
        "engine": {},
        "synthetic": {**asdict(params), "skew": params.skews().tolist(),
                      "predicted_layers": params.predicted().tolist()},
    }
    return Trace(Path(f"<synthetic {name} seed={params.seed}>"), run, steps,
                 routing_frame(sets), pl.DataFrame(schema=LOAD_COLUMNS))


def routing_sets(trace: Trace) -> RoutingSets:
    """Dense decode routing of any trace, positions in (request, step, token) order.
    router = router_experts when recorded, else experts of source="router" rows (else -1);
    predicted = experts of source="prediction" rows (else -1)."""
    decode = trace.steps.filter(pl.col("phase") == "decode").select("step", "request")
    rows = trace.routing.join(decode, on="step", how="inner").filter(
        pl.col("experts").is_not_null())
    model = trace.run.get("model") or {}
    layers = int(model.get("layers") or (int(rows["layer"].max()) + 1 if rows.height else 0))
    engine = trace.run.get("engine") or {}
    # the K the run routed at (engine.k: EngineConfig.top_k may differ from the model's own)
    k = int(engine.get("k") or model.get("k") or (rows["experts"].list.len().max() or 0))
    keys = rows.select("request", "step", "token").unique().sort("request", "step", "token")
    keys = keys.with_row_index("pos")
    rows = rows.join(keys, on=["request", "step", "token"], how="inner")
    P = keys.height
    router = np.full((P, layers, k), -1, dtype=np.int16)
    predicted = np.full((P, layers, k), -1, dtype=np.int16)
    weights = np.zeros((P, layers, k), dtype=np.float32)
    pos = rows["pos"].to_numpy().astype(np.int64)
    lay = rows["layer"].to_numpy().astype(np.int64)

    def dense(col: pl.Series) -> np.ndarray:
        lengths = col.list.len()
        if len(col) and (lengths.min() != k or lengths.max() != k):
            raise BadInput(f"{trace.path / ROUTING_FILE}: {col.name} lists must all have "
                           f"K={k} entries, found lengths {lengths.min()}..{lengths.max()}")
        return col.list.to_array(k).to_numpy()

    is_pred = (rows["source"] == "prediction").to_numpy()
    experts = dense(rows["experts"])
    rec = rows["router_experts"].is_not_null().to_numpy()
    if rec.any():
        router[pos[rec], lay[rec]] = dense(rows["router_experts"].filter(pl.Series(rec)))
    own = ~rec & ~is_pred
    router[pos[own], lay[own]] = experts[own]
    predicted[pos[is_pred], lay[is_pred]] = experts[is_pred]
    if rows["weights"].null_count() == 0:
        weights[pos, lay] = dense(rows["weights"])
    return RoutingSets(router, predicted, weights,
                       keys["step"].to_numpy().astype(np.int64))
