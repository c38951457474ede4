import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.routing_stats import adjacent_overlap, chance_overlap, load_entropy


def test_adjacent_overlap_hand_worked():
    # {0,1} -> {1,2}: shares 1 of 2; {1,2} -> {3,4}: shares 0. Mean (0.5 + 0) / 2.
    assert adjacent_overlap(np.array([[0, 1], [1, 2], [3, 4]])) == pytest.approx(0.25)
    # Order inside a row does not matter: it is a set.
    assert adjacent_overlap(np.array([[1, 0, 5], [5, 0, 1]])) == 1.0
    # K=4: {0,1,2,3} -> {3,2,9,8} shares 2 -> 0.5; -> {8,9,2,7} shares 3 -> 0.75.
    topk = np.array([[0, 1, 2, 3], [3, 2, 9, 8], [8, 9, 2, 7]])
    assert adjacent_overlap(topk) == pytest.approx((0.5 + 0.75) / 2)


def test_adjacent_overlap_edge_cases():
    assert math.isnan(adjacent_overlap(np.zeros((1, 4), dtype=int)))
    with pytest.raises(ValueError):
        adjacent_overlap(np.arange(4))


def test_load_entropy_hand_worked():
    # Loads (2, 2, 0, 0) over 4 experts: entropy ln 2, normalised by ln 4 -> 0.5.
    assert load_entropy(np.array([[0, 1], [1, 0]]), 4) == pytest.approx(0.5)
    # Loads (2, 1, 1) over 3: p = (1/2, 1/4, 1/4), H = 1.5 ln 2, / ln 3.
    assert load_entropy(np.array([0, 0, 1, 2]), 3) == pytest.approx(1.5 * math.log(2) / math.log(3))
    assert load_entropy(np.array([[3, 3], [3, 3]]), 8) == 0.0
    assert load_entropy(np.arange(8).reshape(4, 2), 8) == pytest.approx(1.0)


def test_chance_overlap_matches_independent_random_sets():
    rng = np.random.default_rng(0)
    k, e = 4, 64
    topk = np.stack([rng.choice(e, size=k, replace=False) for _ in range(20_000)])
    assert chance_overlap(k, e) == 0.0625
    assert adjacent_overlap(topk) == pytest.approx(chance_overlap(k, e), abs=0.005)


def _sets(k: int, e: int):
    return st.lists(st.permutations(range(e)).map(lambda p: p[:k]), min_size=2, max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6).flatmap(lambda k: st.tuples(st.just(k), _sets(k, k + 6))))
def test_overlap_is_a_fraction(args):
    k, rows = args
    value = adjacent_overlap(np.array(rows))
    assert 0.0 <= value <= 1.0
    # Every step's overlap is a multiple of 1/K, so the mean over T-1 steps is c / (K (T-1)).
    steps = len(rows) - 1
    assert value * k * steps == pytest.approx(round(value * k * steps))


@settings(max_examples=40, deadline=None)
@given(st.permutations(range(12)), st.integers(2, 30), st.integers(1, 6))
def test_identical_sets_give_one_and_disjoint_give_zero(perm, tokens, k):
    row_a, row_b = perm[:k], perm[k: 2 * k]
    assert adjacent_overlap(np.array([row_a] * tokens)) == 1.0
    alternating = np.array([row_a if t % 2 == 0 else row_b for t in range(tokens)])
    assert adjacent_overlap(alternating) == 0.0


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 32), st.integers(1, 5), st.permutations(range(32)))
def test_uniform_load_has_entropy_one_and_labels_do_not_matter(e, reps, perm):
    ids = np.tile(np.arange(e), reps)
    assert load_entropy(ids, e) == pytest.approx(1.0)
    skewed = np.concatenate([ids, np.zeros(reps, dtype=int)])
    relabel = np.array([p for p in perm if p < e])  # a permutation of range(e)
    assert load_entropy(skewed, e) < 1.0
    assert load_entropy(relabel[skewed], e) == pytest.approx(load_entropy(skewed, e))
