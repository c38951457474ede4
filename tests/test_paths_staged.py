"""The staged path: sticky slots (survivors keep their slot, only changed slots are read),
the device slot table, exact fallback, one-token-ahead staging without host syncs, and the
guarantees that staging never overwrites a queued set and never silently drops an expert."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from layer_reference import stacked_reference
from store_helpers import expert_buffers

from contract.engine_config import EngineConfig
from engine.generate import generate
from engine.loader import load_streaming, streaming_blocks
from engine.manifest import read_manifest
from engine.oracle import RoutingReplay
from engine.paths.exact import ExactPath
from engine.paths.staged import StagedPath, StagingError
from engine.paths.stats import PathStats
from engine.readers import ReaderPool
from engine.store import ExpertStore

PROMPT = "class LRUCache:\n    def __init__(self, capacity):"


@pytest.fixture
def env(tiny_random_converted):
    rows: list[dict] = []
    store = ExpertStore(read_manifest(tiny_random_converted), on_load=rows.append)
    stats = PathStats()
    readers = ReaderPool(store, 2, stats, help_main=False)  # fills on reader threads only
    yield store, stats, readers, rows
    readers.close()
    store.close()


def _call(path, store, experts, rng):
    x = mx.array(rng.standard_normal((1, store.manifest.config["hidden_size"]))
                 .astype(np.float32))
    inds = mx.array(np.array([experts], dtype=np.uint32))
    y = np.array(path(x, inds))
    assert np.array_equal(y, np.array(ExactPath(store, path.layer)(x, inds)))


def test_sticky_slots_and_table(env, tiny_random_converted):
    store, stats, readers, rows = env
    path = StagedPath(store, 1, readers, stats)  # K=4 + headroom 4 = 8 slots
    rng = np.random.default_rng(0)
    assert path.slots == 8
    _call(path, store, [1, 2, 3, 4], rng)
    first = path.resident()
    rows.clear()
    _call(path, store, [3, 4, 5, 6], rng)
    after = path.resident()
    assert after[3] == first[3] and after[4] == first[4]  # survivors keep their slot
    assert sorted(r["expert"] for r in rows if r["thread"] != "main") == [5, 6]  # only changes
    assert (stats.cache_hits, stats.cache_misses, stats.cache_evictions) == (2, 6, 0)
    rows.clear()
    _call(path, store, [7, 8, 9, 10], rng)  # 2 empty slots, then the 2 least recently used
    assert stats.cache_evictions == 2 and 1 not in path.resident() and 2 not in path.resident()
    table = np.array(path.slot_table.table)
    for e, s in path.resident().items():
        assert table[e] == s
    assert all(table[e] == path.sentinel for e in (1, 2))
    ref = stacked_reference(tiny_random_converted / store.manifest.layers[1].file)
    for e, s in path.resident().items():
        for n, v in path.views.items():
            assert np.array_equal(v[s], ref[n][e])
    assert all(not v[path.sentinel].any() for v in path.views.values())  # zero row


def test_slot_victims_are_least_recently_used_not_first_in(env):
    """Hand-worked: survivors' recency is refreshed, so the victim is the least recently USED
    slot. 8 slots (K=4 + 4):
      [1,2,3,4]  fill four empty slots          (used at 1: 1-4)
      [5,6,7,8]  fill the other four            (used at 2: 5-8)
      [1,2,9,10] 1, 2 survive (now used at 3); 9, 10 take the LRU slots of 3, 4
      [5,6,11,12] 5, 6 survive (used at 4); 11, 12 take the LRU slots: 7, 8 (used at 2).
    Without refreshing survivors, 1 and 2 (stamped 1) would go instead."""
    store, stats, readers, rows = env
    path = StagedPath(store, 1, readers, stats)
    rng = np.random.default_rng(1)
    for experts in ([1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 9, 10], [5, 6, 11, 12]):
        _call(path, store, experts, rng)
    assert sorted(path.resident()) == [1, 2, 5, 6, 9, 10, 11, 12]
    assert stats.cache_evictions == 4


def test_no_headroom_and_exact_fallback(env):
    store, stats, readers, rows = env
    path = StagedPath(store, 0, readers, stats, headroom=0)
    rng = np.random.default_rng(1)
    _call(path, store, [1, 2, 3, 4], rng)
    s3 = path.resident()[3]
    _call(path, store, [3, 4, 5, 6], rng)
    assert path.resident()[3] == s3 and set(path.resident()) == {3, 4, 5, 6}
    before = path.resident()
    xs = mx.array(rng.standard_normal((3, store.manifest.config["hidden_size"]))
                  .astype(np.float32))
    big = mx.array(np.arange(12, dtype=np.uint32).reshape(3, 4))
    assert np.array_equal(np.array(path(xs, big)), np.array(ExactPath(store, 0)(xs, big)))
    assert stats.exact_fallbacks == 1 and path.resident() == before


def test_staging_never_overwrites_queued_sets(env):
    store, stats, readers, rows = env
    path = StagedPath(store, 0, readers, stats)  # 8 slots
    path.stage([1, 2, 3, 4])
    path.stage([5, 6, 7, 8])  # the first set is queued: must land in the other 4 slots
    assert len(set(path.resident().values())) == 8
    with pytest.raises(StagingError, match="free slots"):
        path.stage([9, 10, 11, 12])
    assert all(r["source"] == "prefetch" for r in rows)


def test_unstaged_expert_is_an_error_not_a_silent_drop(env):
    store, stats, readers, rows = env
    path = StagedPath(store, 0, readers, stats)
    path.stage([1, 2, 3, 4])
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((1, store.manifest.config["hidden_size"]))
                 .astype(np.float32))
    mx.eval(path(x, mx.array(np.array([[1, 2, 3, 9]], dtype=np.uint32))))
    with pytest.raises(StagingError, match=r"routed experts \[9\] were not staged"):
        path.verify()


@pytest.mark.parametrize("headroom", [None, 8])  # K: one set ahead; 2K: two sets ahead
def test_one_token_ahead_no_host_sync_same_tokens(tiny_random_converted, headroom):
    config = EngineConfig.from_preset("staged", lead=1, help_reads=False,
                                      staged_headroom=headroom)
    eng = load_streaming(tiny_random_converted, config=config)
    model, tok, store = eng.model, eng.tokenizer, eng.store
    rt = eng.runtime
    ref = generate(model, tok, PROMPT, 20, stop_at_eos=False, runtime=eng.runtime)
    # record the routing of an identical run, then replay it one token ahead
    replay = RoutingReplay()
    on_start, on_routing, finish = replay.recorder()
    for block in streaming_blocks(model).values():
        block.on_routing = on_routing
    generate(model, tok, PROMPT, 20, stop_at_eos=False, runtime=eng.runtime, on_step_start=on_start)
    finish()
    for block in streaming_blocks(model).values():
        block.on_routing = None
    loads: list[dict] = []
    store.on_load = loads.append
    before = rt.stats.snapshot()
    out = generate(model, tok, PROMPT, 20, stop_at_eos=False, runtime=eng.runtime,
                   on_step_start=replay.driver(rt.staged()))
    for p in rt.staged().values():
        p.verify()
    d = rt.stats.delta(rt.stats.snapshot(), before)
    assert out.tokens == ref.tokens
    assert d["route_syncs"] == 0  # routing never left the device
    bundle_loads = [r for r in loads if r["expert"] >= 0]
    assert bundle_loads and all(r["source"] == "prefetch" for r in bundle_loads)
    off_main = "native" if rt.config.readers_kind == "native" else "reader-"
    assert all(r["thread"].startswith(off_main) for r in bundle_loads)
    assert sum(r["wait_ns"] for r in loads if r["thread"] != "main") == d["blocked_ns"]
    eng.close()


def test_main_thread_helps_only_with_unstarted_reads(env, monkeypatch):
    store, stats, _, rows = env
    idle = ReaderPool(store, 1, stats, help_main=True)
    monkeypatch.setattr(idle, "_start", lambda: None)  # readers never run: main must read
    path = StagedPath(store, 0, idle, stats)
    _call(path, store, [1, 2, 3, 4], np.random.default_rng(3))
    assert sorted(r["expert"] for r in rows if r["thread"] == "main") == [1, 1, 2, 2, 3, 3, 4, 4]
    assert all(r["waited"] for r in rows)


def test_warm_misses_read_on_main_cold_ones_in_parallel(env, monkeypatch):
    """Held (on-demand) misses: page-cache copies happen on the main thread, no reader wakes;
    cold misses: the first on the main thread, the others handed to the readers."""
    store, stats, _, rows = env
    pool = ReaderPool(store, 2, stats, help_main=True)
    started = []
    real_start = pool._start
    monkeypatch.setattr(pool, "_start", lambda: (started.append(1), real_start()))
    path = StagedPath(store, 0, pool, stats)
    rng = np.random.default_rng(5)
    hidden = store.manifest.config["hidden_size"]

    def call(experts):
        x = mx.array(rng.standard_normal((1, hidden)).astype(np.float32))
        inds = mx.array(np.array([experts], dtype=np.uint32))
        y = np.array(path(x, inds))
        mine = list(rows)
        assert np.array_equal(y, np.array(ExactPath(store, 0)(x, inds)))
        rows.clear()
        return mine

    for e in (1, 2, 3, 4):  # cache the bundles' pages
        store.read_bundle(0, e, expert_buffers(store, 0), emit=False)
    mine = call([1, 2, 3, 4])
    assert [r["thread"] for r in mine] == ["main"] * 4 and not started
    assert all(r["waited"] and not r["cold"] for r in mine)
    store.drop_page_cache()
    if store.page_cache_bytes() != 0:
        pool.close()
        pytest.skip("this filesystem keeps file pages resident (tmpfs?): nothing is cold")
    # experts 8 apart (64 KiB of each weight tensor): a cold read's folio brings in its
    # neighbours' slices (4 experts' scales share a page here), which would make them warm
    mine = call([0, 8, 16, 24])
    assert sorted(r["expert"] for r in mine) == [0, 8, 16, 24]
    assert sum(r["cold"] for r in mine) >= 2  # the first on the main thread, others to readers
    assert started  # the cold ones went to the readers
    assert sum(r["thread"] == "main" for r in mine) >= 1
    pool.close()


def test_large_warm_misses_still_copy_in_parallel(env, monkeypatch):
    """Bundles above INLINE_WARM_BYTES: the main thread keeps the first held miss and hands the
    others to the readers (as for cold ones), which copy them in parallel."""
    store, stats, _, rows = env
    monkeypatch.setattr("engine.readers.INLINE_WARM_BYTES", 0)
    pool = ReaderPool(store, 2, stats, help_main=True)
    queued = []
    real_enqueue = pool._enqueue
    monkeypatch.setattr(pool, "_enqueue", lambda t: (queued.append(t.expert), real_enqueue(t)))
    path = StagedPath(store, 0, pool, stats)
    for e in (1, 2, 3, 4):  # cache the bundles' pages
        store.read_bundle(0, e, expert_buffers(store, 0), emit=False)
    rng = np.random.default_rng(6)
    x = mx.array(rng.standard_normal((1, store.manifest.config["hidden_size"]))
                 .astype(np.float32))
    inds = mx.array(np.array([[1, 2, 3, 4]], dtype=np.uint32))
    y = np.array(path(x, inds))
    assert sorted(queued) == [2, 3, 4]  # all but the first
    assert np.array_equal(y, np.array(ExactPath(store, 0)(x, inds)))
    pool.close()


def test_o_direct_rows_keep_the_residency_classification(tiny_random_converted):
    """Under O_DIRECT nothing is copied from the page cache, and a demand miss's row is classed
    cold or warm by page-cache residency, as the exact path's rows are (not by the refused
    warm-only attempt)."""
    rows: list[dict] = []
    store = ExpertStore(read_manifest(tiny_random_converted), o_direct=True, on_load=rows.append)
    if not store.direct:
        store.close()
        pytest.skip("O_DIRECT not available on this filesystem")
    stats = PathStats()
    pool = ReaderPool(store, 2, stats, help_main=True)
    for e in (1, 2, 3, 4):  # cache the bundles' pages: residency says warm
        store.read_bundle(0, e, expert_buffers(store, 0), emit=False)
    resident = [store.residency(0, e) == 1.0 for e in (1, 2, 3, 4)]
    rows.clear()
    path = StagedPath(store, 0, pool, stats)
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal((1, store.manifest.config["hidden_size"]))
                 .astype(np.float32))
    inds = mx.array(np.array([[1, 2, 3, 4]], dtype=np.uint32))
    y = np.array(path(x, inds))
    mine = sorted((r["expert"], r["cold"]) for r in rows)
    assert mine == [(e, not warm) for e, warm in zip((1, 2, 3, 4), resident, strict=True)]
    assert np.array_equal(y, np.array(ExactPath(store, 0)(x, inds)))
    pool.close()
    store.close()
