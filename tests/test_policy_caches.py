"""Every cache that evicts runs the policy it is given, checked on hand-worked sequences
(test_eviction_policies.py has the orders worked out, docs/policies.md the working): the
engine's hot pool (through the fill point's all-hit short path and its misses), the staged slot
table (its all-hit short path and place), the page-cache budget's drops, and the simulator's hot
path, slot tables and page cache, which must agree with the engine's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import polars as pl
import pytest
from sim_helpers import MB, model, routing_input, scenario
from test_eviction_policies import EXPECTED, SEQUENCE, STAMPS, new_policy

from contract.errors import BadInput
from contract.eviction import check_policy, make
from engine.fill_points import FillPoints
from engine.loader import routed_at
from engine.manifest import read_manifest
from engine.page_cache_budget import PageCacheBudget
from engine.paths.hot import HotPath, HotPool
from engine.paths.slot_table import SlotTable
from engine.paths.stats import PathStats
from engine.readers import ReaderPool
from engine.store import ExpertStore
from sim.caches import BundleLRU, SlotTables
from sim.page_cache import PageCache
from sim.profiles import check_scenario
from sim.replay import run_scenario

EXPERT = {name: i + 1 for i, name in enumerate("ABCDE")}  # the sequence's experts as ids
NAME = {i: name for name, i in EXPERT.items()}
ENGINE = ("lru", "fifo", "lfu", "least-stale")

# one layer, 3 slots (K=1 + headroom 2), experts in call order; worked out in docs/policies.md
SLOT_SEQUENCE = [0, 1, 2, 0, 3, 0, 1, 2, 3, 0]
SLOT_HITS = {"lru": [3, 5], "least-stale": [3, 5], "fifo": [3], "lfu": [3, 5, 9]}


@pytest.fixture
def k1_store(tiny_random_converted):
    """The tiny model's store routing one expert per token (K=1), so that a pool of 3 rows
    holds more than one layer's working set."""
    store = ExpertStore(routed_at(read_manifest(tiny_random_converted), 1))
    stats = PathStats()
    readers = ReaderPool(store, 2, stats, help_main=False)
    yield store, stats, readers
    readers.close()
    store.close()


@pytest.mark.parametrize("name", ENGINE)
def test_engine_hot_pool_follows_the_policy(k1_store, name):
    store, stats, readers = k1_store
    pool = HotPool(store, readers, stats, 3 * store.manifest.bundle_bytes, name)
    points = FillPoints()
    paths = {layer: HotPath(store, layer, pool, points) for layer in (0, 1)}
    orders, hits = EXPECTED[name]
    for i, ((layer, key), (token, _)) in enumerate(zip(SEQUENCE, STAMPS, strict=True)):
        points.clock.step = token
        before = stats.cache_hits
        paths[layer]._fill(mx.array([[EXPERT[key]]], dtype=mx.uint32))  # fill point
        assert (stats.cache_hits > before) == (i + 1 in hits), (name, i + 1)
        order = [f"{NAME[e]}" for _, e in pool.policy.order()]
        assert order == orders[i], (name, i + 1)
        held = {(lay, e) for lay in (0, 1) for e in range(store.manifest.num_experts)
                if pool.tables_np[lay][e] != pool.rows}
        assert held == set(pool.row_of) == set(pool.policy)  # the table agrees


def test_engine_hot_pool_refreshes_the_hits_of_a_call_with_misses(k1_store):
    """rows_for with hits and misses in one call (a prefill-sized set): its hits are used at
    the call's stamp before its misses pick victims (hand-worked, LRU)."""
    store, stats, readers = k1_store
    pool = HotPool(store, readers, stats, 3 * store.manifest.bundle_bytes, "lru")
    pool.rows_for(0, [1, 2], token=0)
    pool.rows_for(0, [3], token=1)
    assert [e for _, e in pool.policy.order()] == [1, 2, 3]
    pool.rows_for(0, [1, 4], token=2)  # 1 hits (now the latest), 4 takes 2's row
    assert [e for _, e in pool.policy.order()] == [3, 1, 4]
    pool.rows_for(0, [5], token=3)  # 3 goes (unrefreshed, 1 would have)
    assert [e for _, e in pool.policy.order()] == [1, 4, 5]


@pytest.mark.parametrize("name", ENGINE)
def test_engine_slot_table_follows_the_policy(k1_store, name):
    store, stats, readers = k1_store
    table = SlotTable(store, 0, readers, stats, k=1, headroom=2, policy=name)
    hits = []
    for i, e in enumerate(SLOT_SEQUENCE):
        if table.all_published([e]) is not None:  # the all-hit short path
            hits.append(i)
        else:
            table.settle(table.place([e], set(), source="demand"))
    assert hits == SLOT_HITS[name]
    assert sorted(table.resident()) == sorted(table.policy)


def test_engine_slot_table_refreshes_survivors_of_a_call_with_misses(k1_store):
    """place() with a survivor and a miss: the survivor is used before the miss picks its
    victim (hand-worked, LRU)."""
    store, stats, readers = k1_store
    table = SlotTable(store, 0, readers, stats, k=1, headroom=2, policy="lru")
    for wanted in ([0, 1, 2], [0, 3]):
        table.settle(table.place(wanted, set(), source="demand"))
    assert table.policy.order() == [2, 0, 3]
    table.settle(table.place([4], set(), source="demand"))
    assert table.policy.order() == [0, 3, 4]  # 2 went; unrefreshed, 0 would have


@pytest.mark.parametrize("name", ENGINE)
def test_sim_slot_tables_hit_as_the_engine_does(name):
    m = model(layers=1, experts=8, k=1)
    sc = scenario(m=m, path="staged", staged_headroom=2, lru_bytes=0, cache_policy=name,
                  decode_steps=len(SLOT_SEQUENCE))
    router = np.array(SLOT_SEQUENCE, dtype=np.int16).reshape(-1, 1, 1)
    steps = run_scenario(sc, routing=routing_input(router)).trace.steps
    got = steps.filter(pl.col("phase") == "decode")["cache_hits"].to_list()
    assert [i for i, h in enumerate(got) if h] == SLOT_HITS[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sim_hot_path_hits_as_worked_out(name):
    """The simulator's hot path on the same sequence (two layers, K=1, 3 bundles): the hits
    per step are the hand-worked ones, Belady's included."""
    m = model(layers=2, experts=8, k=1)
    sc = scenario(m=m, path="hot", lru_bytes=3 * MB, cache_policy=name, decode_steps=5)
    check_scenario(sc)
    router = np.array([EXPERT[key] for _, key in SEQUENCE], dtype=np.int16).reshape(5, 2, 1)
    steps = run_scenario(sc, routing=routing_input(router)).trace.steps
    got = steps.filter(pl.col("phase") == "decode")["cache_hits"].to_list()
    want = [0] * 5
    for access in EXPECTED[name][1]:
        want[(access - 1) // 2] += 1
    assert got == want


@pytest.mark.parametrize("name", ENGINE)
def test_engine_budget_and_sim_page_cache_drop_the_same_bundles(name):
    """The page-cache budget (3 bundles of one page) drops what the policy names, in the order
    the hand-worked sequence gives; the simulator's page cache in budget mode holds the same."""
    dropped: list[int] = []
    budget = PageCacheBudget(3 * 4096, lambda fd, off, ln: dropped.append(off // 4096),
                             policy=name)
    pc = PageCache(3 * 4096, 4096, 8, policy=name)
    for (layer, key), (token, _) in zip(SEQUENCE, STAMPS, strict=True):
        e = EXPERT[key]
        budget.charge((layer, e), 3, [(e * 4096, 4096)], step=token)
        if not pc.probe(layer * 8 + e, (token, layer)):
            pc.fill(layer * 8 + e, (token, layer))
    orders, hits = EXPECTED[name]
    layer_of = {key: layer for layer, key in SEQUENCE}
    final = orders[-1]
    assert budget.policy.order() == [(layer_of[k], EXPERT[k]) for k in final]
    assert pc.lru.policy.order() == [layer_of[k] * 8 + EXPERT[k] for k in final]
    assert len(dropped) == len(SEQUENCE) - len(hits) - 3  # each miss past the third evicts one


def test_bad_policies_are_one_line():
    from contract.engine_config import EngineConfig

    with pytest.raises(BadInput, match="unknown policy 'mru'"):
        EngineConfig.from_preset("hot", cache_policy="mru")
    with pytest.raises(BadInput, match="needs the future"):
        EngineConfig.from_preset("hot", cache_policy="belady")
    with pytest.raises(BadInput, match="no cache"):
        EngineConfig.from_preset("on-demand", cache_policy="lfu")
    assert EngineConfig.from_preset("on-demand", cache_policy="lfu",
                                    page_cache_budget=1 << 20).cache_policy == "lfu"
    assert EngineConfig.from_preset("hot").cache_policy == "lru"  # recorded in run.json
    assert EngineConfig.from_preset("on-demand").cache_policy is None
    sc = scenario(path="staged", cache_policy="belady")
    with pytest.raises(BadInput, match="belady runs on the hot path"):
        check_scenario(sc)
    with pytest.raises(BadInput, match="exact path, which has no cache"):
        check_scenario(scenario(path="exact", cache_policy="lfu"))
    assert check_policy("fifo") == "fifo"


@pytest.mark.parametrize("args,needle", [
    (["--preset", "on-demand", "--cache-policy", "lfu"], "no cache"),
    (["--preset", "hot", "--cache-policy", "mru"], "unknown policy 'mru'"),
    (["--preset", "hot", "--cache-policy", "belady"], "needs the future"),
])
def test_cli_bad_policy_is_one_line_and_writes_nothing(tiny_random_converted, tmp_path,
                                                       monkeypatch, capsys, args, needle):
    from cli_runner import run_cli

    out = tmp_path / "trace"
    code, _, err = run_cli(monkeypatch, capsys, "capture", str(tiny_random_converted),
                           "--out", str(out), "--max-tokens", "2", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not out.exists()


def test_cli_generate_records_the_policy(tiny_random_converted, tmp_path, monkeypatch, capsys):
    import json

    from cli_runner import run_cli

    out = tmp_path / "trace"
    code, _, err = run_cli(monkeypatch, capsys, "generate", str(tiny_random_converted),
                           "--prompt", "hello", "--max-tokens", "3", "--preset", "staged",
                           "--cache-policy", "least-stale", "--trace", str(out))
    assert code == 0, err
    assert json.loads((out / "run.json").read_text())["engine"]["cache_policy"] == "least-stale"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sim_bundle_cache_order_after_every_access(name):
    """The simulator's shared bundle cache (sim.caches.BundleLRU, as sim.main_thread drives it:
    a lookup, and an insert on a miss) holds the hand-worked order after every access."""
    orders, hits = EXPECTED[name]
    cache = BundleLRU(3 * 1000, 1000, new_policy(name) if name == "belady" else make(name))
    got = []
    for i, ((_, key), now) in enumerate(zip(SEQUENCE, STAMPS, strict=True), start=1):
        if cache.lookup(key, now):
            got.append(i)
        else:
            cache.insert(key, now)
        assert cache.policy.order() == orders[i - 1], (name, i)
    assert got == hits and cache.hits == len(hits)


@pytest.mark.parametrize("name", ENGINE)
def test_sim_slot_tables_order_matches_the_engines(k1_store, name):
    """The simulator's slot tables and the engine's slot table, driven by the same calls,
    hold the same eviction order after every call."""
    store, stats, readers = k1_store
    engine = SlotTable(store, 0, readers, stats, k=1, headroom=2, policy=name)
    sim = SlotTables(1, 3, name)
    for e in SLOT_SEQUENCE:
        if engine.all_published([e]) is None:
            engine.settle(engine.place([e], set(), source="demand"))
        sim.touch(0, [e])
        if e not in sim.held[0]:
            sim.place(0, e, None, {e})
        assert sim.policies[0].order() == engine.policy.order(), (name, e)


@pytest.mark.parametrize("name", ENGINE)
def test_sim_hot_path_hits_as_the_engines_pool_on_random_routing(tiny_random_converted, name):
    """The engine's hot pool (through its fill points) and the simulator's hot path on the same
    60 steps of random K-sets: the same hits at every step (the engine is the reference: a call's
    experts in its order, its misses' rows freed before they are admitted)."""
    store = ExpertStore(read_manifest(tiny_random_converted))
    stats = PathStats()
    readers = ReaderPool(store, 2, stats, help_main=False)
    try:
        m = store.manifest
        layers, experts, k = len(m.moe_layers), m.num_experts, m.top_k
        rng = np.random.default_rng(7)
        # skewed so that reuse happens: the first 12 experts drawn 8x as often
        weights = np.where(np.arange(experts) < 12, 8.0, 1.0)
        weights /= weights.sum()
        router = np.stack([[rng.choice(experts, size=k, replace=False, p=weights)
                            for _ in range(layers)] for _ in range(60)]).astype(np.int16)
        rows = 6 * k  # one and a half steps of the 4 layers
        pool = HotPool(store, readers, stats, rows * m.bundle_bytes, name)
        points = FillPoints()
        paths = {i: HotPath(store, layer, pool, points) for i, layer in enumerate(m.moe_layers)}
        engine_hits = []
        for step in range(len(router)):
            points.clock.step = step
            before = stats.cache_hits
            for i in range(layers):
                paths[i]._fill(mx.array(router[step, i][None, :].astype(np.uint32)))
            engine_hits.append(stats.cache_hits - before)
    finally:
        readers.close()
        store.close()
    sc = scenario(m=model(layers=layers, experts=experts, k=k), path="hot",
                  lru_bytes=rows * MB, cache_policy=name, decode_steps=len(router))
    steps = run_scenario(sc, routing=routing_input(router)).trace.steps
    sim_hits = steps.filter(pl.col("phase") == "decode")["cache_hits"].to_list()
    assert sum(engine_hits) > 0 and sim_hits == engine_hits
