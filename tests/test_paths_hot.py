"""The hot path's shared LRU: bounded in bytes, hit/miss/eviction counts on a hand-worked
sequence, rows hold the right bytes, oversize sets fall back to exact."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from layer_reference import stacked_reference

from contract.errors import BadInput
from engine.manifest import read_manifest
from engine.paths.exact import ExactPath
from engine.paths.hot import HotPath, HotPool
from engine.paths.stats import PathStats
from engine.readers import ReaderPool
from engine.store import ExpertStore


@pytest.fixture
def env(tiny_random_converted):
    rows: list[dict] = []
    store = ExpertStore(read_manifest(tiny_random_converted), on_load=rows.append)
    stats = PathStats()
    readers = ReaderPool(store, 2, stats, help_main=False)  # every read on a reader thread
    yield store, stats, readers, rows
    readers.close()
    store.close()


def test_lru_counts_hand_worked(env, tiny_random_converted):
    store, stats, readers, rows = env
    b = store.manifest.bundle_bytes
    pool = HotPool(store, readers, stats, 5 * b + b // 2)  # 5.5 bundles: 5 rows
    assert pool.rows == 5 and pool.nbytes <= 5 * b + b // 2
    seq = [  # (layer, experts) -> expected (hits, misses, evictions) after the call
        (0, [1, 2, 3, 4], (0, 4, 0)),
        (1, [1, 2, 3, 4], (0, 8, 3)),  # one free row, then evicts (0,1) (0,2) (0,3)
        (0, [4, 5, 6, 7], (1, 11, 6)),  # (0,4) hits; evicts (1,1) (1,2) (1,3)
        (1, [4, 1, 9, 10], (2, 14, 9)),  # (1,4) hits; evicts (0,4) (0,5) (0,6)
    ]
    for layer, experts, want in seq:
        got = pool.rows_for(layer, experts, token=0)
        assert sorted(got) == sorted(experts)
        assert (stats.cache_hits, stats.cache_misses, stats.cache_evictions) == want
    assert set(pool.row_of) == {(0, 7), (1, 4), (1, 1), (1, 9), (1, 10)}
    assert len(rows) == 14 and all(r["thread"].startswith("reader-") for r in rows)
    # every resident row holds its expert's bytes
    for (layer, e), row in pool.row_of.items():
        ref = stacked_reference(tiny_random_converted / store.manifest.layers[layer].file)
        for n, v in pool.views.items():
            assert np.array_equal(v[row], ref[n][e]), (layer, e, n)


def test_hits_gather_from_pool_and_oversize_falls_back(env):
    store, stats, readers, rows = env
    m = store.manifest
    pool = HotPool(store, readers, stats, m.top_k * m.bundle_bytes)  # the minimum
    path = HotPath(store, 0, pool)
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((1, m.config["hidden_size"])).astype(np.float32))
    inds = mx.array(np.array([[5, 3, 9, 1]], dtype=np.uint32))
    first = np.array(path(x, inds))
    rows.clear()
    again = np.array(path(x, inds))  # all hits: no reads
    assert rows == [] and np.array_equal(first, again)
    assert np.array_equal(first, np.array(ExactPath(store, 0)(x, inds)))
    # 3 tokens x 4 distinct = 12 experts > 4 rows: exact for that call, pool untouched
    before = dict(pool.row_of)
    xs = mx.array(rng.standard_normal((3, m.config["hidden_size"])).astype(np.float32))
    big = mx.array(np.arange(12, dtype=np.uint32).reshape(3, 4))
    assert np.array_equal(np.array(path(xs, big)), np.array(ExactPath(store, 0)(xs, big)))
    assert stats.exact_fallbacks == 1 and pool.row_of == before


def test_budget_below_working_set_names_minimum(env):
    store, stats, readers, _ = env
    m = store.manifest
    need = m.top_k * m.bundle_bytes
    with pytest.raises(BadInput, match=f"minimum {need} bytes"):
        HotPool(store, readers, stats, need - 1)
