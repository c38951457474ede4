"""The synthetic routing generator reproduces the statistics it is given."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from contract.errors import BadInput
from sim.routing_synth import (
    MAX_INCLUSION,
    SynthRouting,
    generate_sets,
    routing_frame,
    routing_sets,
    synthetic_trace,
    target_inclusion,
    target_load,
)
from traces.reader import read_trace
from traces.run_info import RunInfo
from traces.schema import ROUTING_COLUMNS
from traces.summary import summarize
from traces.writer import TraceWriter


def _overlap(sets: np.ndarray) -> float:
    """Mean |S_t & S_t-1| / K over t and layers, with Python sets (independent of numpy tricks)."""
    T, L, K = sets.shape
    total = sum(len(set(sets[t, j]) & set(sets[t - 1, j]))
                for t in range(1, T) for j in range(L))
    return total / ((T - 1) * L * K)


def _load_shares(sets: np.ndarray, n: int) -> np.ndarray:
    T, L, K = sets.shape
    return np.stack([np.bincount(sets[:, j].ravel(), minlength=n) / (T * K) for j in range(L)])


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    m = p > 0
    return float((p[m] * np.log(p[m] / q[m])).sum())


@pytest.mark.parametrize("reuse", [0.0, 0.25, 0.6])
def test_adjacent_overlap_matches_reuse(reuse):
    params = SynthRouting(layers=8, experts=64, k=4, steps=1500, skew=0.7, reuse=reuse, seed=5)
    measured = _overlap(generate_sets(params).router)
    # Per (step, layer) the overlap is Binomial(4, reuse)/4, independent across steps:
    # standard error sqrt(r(1-r)/4 / 12000) <= 0.0023; allow 5 of them.
    assert abs(measured - reuse) < 0.012


def _novelty(sets: np.ndarray, w: int) -> float:
    """Share of a token's experts absent from the last w tokens' sets, with Python sets."""
    T, L, K = sets.shape
    missing = sum(len(set(sets[t, j]) - set(sets[t - w:t, j].ravel()))
                  for t in range(w, T) for j in range(L))
    return missing / ((T - w) * L * K)


def test_recall_copies_from_recent_tokens_and_keeps_adjacent_reuse():
    base = dict(layers=6, experts=64, k=4, steps=1200, skew=0.3, reuse=0.2, seed=4)
    plain = generate_sets(SynthRouting(**base)).router
    recalled = generate_sets(SynthRouting(**base, recall=0.6, window=16)).router
    # the fresh draws still exclude the previous set: adjacent overlap stays `reuse`
    assert abs(_overlap(recalled) - 0.2) < 0.012
    # Without recall a fresh slot is a popularity draw. With recall 0.6 over the last 16 sets
    # (the current one and 15 before it), at most the other 40% of fresh slots can be new to
    # the last 15 tokens: novelty(15) <= (1 - reuse) x (1 - recall).
    assert _novelty(plain, 15) > 0.3
    assert _novelty(recalled, 15) <= (1 - 0.2) * (1 - 0.6)
    assert _novelty(recalled, 15) < _novelty(plain, 15) - 0.1
    assert _novelty(recalled, 8) < _novelty(plain, 8) - 0.1
    # recall = 0 is the plain chain, draw for draw (old parameters keep their routing)
    same = generate_sets(SynthRouting(**base, recall=0.0, window=3)).router
    assert np.array_equal(same, plain)


def test_load_distribution_matches_target_and_not_a_neighbour():
    n, k, steps, reuse = 64, 4, 4000, 0.25
    for skew in (0.0, 0.5, 1.0, 1.5):
        params = SynthRouting(layers=6, experts=n, k=k, steps=steps, skew=skew, reuse=reuse,
                              seed=11)
        shares = _load_shares(generate_sets(params).router, n)
        target = target_load(params)
        wrong = target_load(SynthRouting(layers=6, experts=n, k=k, skew=skew + 0.3,
                                         reuse=reuse, seed=11))
        # Expected KL of an empirical distribution of m draws: (n-1)/(2m), times the variance
        # inflation (1+r)/(1-r) of a chain whose slots persist with probability r.
        noise = (n - 1) / (2 * steps * k) * (1 + reuse) / (1 - reuse)
        kl = [_kl(shares[j], target[j]) for j in range(6)]
        kl_wrong = [_kl(shares[j], wrong[j]) for j in range(6)]
        assert np.mean(kl) < 1.5 * noise, (skew, np.mean(kl), noise)
        assert min(kl_wrong) > 3 * noise, (skew, min(kl_wrong))


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum() / math.log(128))


def test_entropy_decreases_with_skew_and_matches_target():
    n = 128
    entropies, targets = [], []
    for skew in (0.0, 0.4, 0.8, 1.2, 1.6):
        params = SynthRouting(layers=4, experts=n, k=8, steps=1500, skew=skew, seed=2)
        shares = _load_shares(generate_sets(params).router, n)
        entropies.append(np.mean([_entropy(row) for row in shares]))
        targets.append(np.mean([_entropy(row) for row in target_load(params)]))
    assert all(a > b + 0.01 for a, b in zip(entropies, entropies[1:], strict=False)), entropies
    assert np.allclose(entropies, targets, atol=0.01), (entropies, targets)


def test_target_is_capped_zipf():
    params = SynthRouting(layers=3, experts=32, k=4, skew=[0.0, 1.0, 3.0], seed=1)
    incl = target_inclusion(params)
    assert np.allclose(incl.sum(axis=1), 4)
    assert incl.max() <= MAX_INCLUSION + 1e-12
    assert np.allclose(incl[0], 4 / 32)
    # Uncapped experts keep Zipf ratios: rank r over rank 1 of the uncapped = (r1 / r)^skew.
    row = np.sort(incl[1])[::-1]
    free = row[row < MAX_INCLUSION - 1e-9]
    ranks = np.arange(1, 33)[row < MAX_INCLUSION - 1e-9]
    assert np.allclose(free / free[0], ranks[0] / ranks)
    assert np.sum(np.isclose(incl[2], MAX_INCLUSION)) >= 3  # very skewed: several at the cap


@pytest.mark.parametrize("accuracy", [0.3, 0.8, 1.0])
def test_prediction_accuracy_matches(accuracy):
    params = SynthRouting(layers=10, experts=64, k=4, steps=1000, skew=0.5,
                          prediction_accuracy=accuracy, predicted_layers=range(3, 9), seed=4)
    sets = generate_sets(params)
    assert list(sets.predicted_layers()) == list(range(3, 9))
    assert (sets.predicted[:, [0, 1, 2, 9]] == -1).all()
    hits = [len(set(sets.predicted[t, j]) & set(sets.router[t, j]))
            for t in range(1000) for j in range(3, 9)]
    assert abs(np.mean(hits) / 4 - accuracy) < 0.015
    assert all(len(set(row)) == 4 for row in sets.predicted[:, 3:9].reshape(-1, 4))


def test_sets_are_distinct_valid_and_deterministic():
    params = SynthRouting(layers=5, experts=16, k=8, steps=300, skew=1.0, reuse=0.5,
                          prediction_accuracy=0.5, seed=9)
    a, b = generate_sets(params), generate_sets(params)
    for arr in (a.router, a.predicted[:, 1:]):
        flat = arr.reshape(-1, 8)
        assert flat.min() >= 0 and flat.max() < 16
        assert all(len(set(row)) == 8 for row in flat)
    assert np.array_equal(a.router, b.router) and np.array_equal(a.predicted, b.predicted)
    c = generate_sets(SynthRouting(**{**params.__dict__, "seed": 10}))
    assert not np.array_equal(a.router, c.router)
    assert np.allclose(a.weights.sum(axis=-1), 1, atol=1e-6)


def test_paper_scale_shapes():
    """Paper scale runs (its speed is measured by reports/sim/speed.py, not asserted here)."""
    params = SynthRouting(layers=40, experts=256, k=4, steps=1000, skew=0.8,
                          prediction_accuracy=0.7)
    sets = generate_sets(params)
    assert sets.router.shape == sets.predicted.shape == (1000, 40, 4)
    assert sets.router.min() >= 0 and sets.router.max() < 256
    # predictions keep about 70% of the routed experts
    kept = np.mean([len(set(a) & set(b)) / 4 for a, b in
                    zip(sets.router.reshape(-1, 4), sets.predicted.reshape(-1, 4), strict=True)])
    assert kept == pytest.approx(0.7, abs=0.03)


def test_bad_parameters_raise():
    for bad in (dict(k=40, experts=64), dict(reuse=1.5), dict(prediction_accuracy=-0.1),
                dict(skew=-1.0), dict(skew=[0.5, 0.5], layers=3), dict(steps=0),
                dict(prediction_accuracy=0.5, predicted_layers=[40]), dict(recall=1.2),
                dict(recall=0.5, window=0)):
        with pytest.raises(ValueError):
            generate_sets(SynthRouting(**bad))


def test_trace_encoding_round_trips_and_summarizes(tmp_path):
    params = SynthRouting(layers=6, experts=32, k=4, steps=200, skew=0.5, reuse=0.3,
                          prediction_accuracy=0.6, predicted_layers=[2, 3, 4], seed=3)
    sets = generate_sets(params)
    trace = synthetic_trace(params, bundle_bytes=1000, name="tiny", sets=sets)
    assert trace.kind == "synthetic" and trace.complete
    assert trace.run["model"] == {"name": "tiny", "architecture": "synthetic", "layers": 6,
                                  "experts": 32, "k": 4, "bundle_bytes": 1000}
    assert dict(trace.routing.schema) == ROUTING_COLUMNS
    row = trace.routing.filter(pl.col("step") == 7, pl.col("layer") == 3).row(0, named=True)
    assert row["source"] == "prediction"
    assert row["experts"] == sets.predicted[7, 3].tolist()
    assert row["router_experts"] == sets.router[7, 3].tolist()
    assert trace.routing.filter(pl.col("layer") == 1)["source"].unique().to_list() == ["router"]
    back = routing_sets(trace)
    assert np.array_equal(back.router, sets.router)
    assert np.array_equal(back.predicted, sets.predicted)
    # summary measures the executed sets (`experts`): predicted where predicted
    executed = np.where(sets.predicted >= 0, sets.predicted, sets.router)
    assert summarize(trace)["adjacent_overlap"] == pytest.approx(_overlap(executed))
    # The in-memory trace writes and reads back like any other.
    with TraceWriter(tmp_path / "t", RunInfo(model=trace.run["model"], engine={},
                                             kind="synthetic")) as writer:
        for r in trace.steps.iter_rows(named=True):
            writer.add_step(r)
        for r in routing_frame(sets).iter_rows(named=True):
            writer.add_routing(r)
    again = routing_sets(read_trace(tmp_path / "t"))
    assert np.array_equal(again.router, sets.router)


def test_routing_sets_rejects_ragged_lists():
    params = SynthRouting(layers=2, experts=8, k=2, steps=3)
    trace = synthetic_trace(params, bundle_bytes=1)
    trace.routing = trace.routing.with_columns(
        pl.when(pl.col("step") == 1).then(pl.lit([1, 2, 3], dtype=pl.List(pl.Int16)))
        .otherwise(pl.col("experts")).alias("experts"))
    with pytest.raises(BadInput, match="routing.parquet: experts lists must all have K=2"):
        routing_sets(trace)
