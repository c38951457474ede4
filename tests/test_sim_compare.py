"""`sim compare`: a trace captured here is replayed with its engine configuration; the output
has every summary key; with free storage the simulated decode speed is the compute-bound closed
form; engine configs map onto the scenario keys they stand for."""

from __future__ import annotations

import json

import pytest
from sim_helpers import model, scenario

from contract.errors import BadInput
from sim.compare import compare, engine_settings, scenario_for
from traces.reader import read_trace
from traces.schema import SUMMARY_KEYS

FREE_STORAGE = ["ssd_latency_ms=0", "ssd_bandwidth_gbps=1e9", "load_overhead_ms=0",
                "cold_overhead_ms=0", "memcpy_gbps=0"]
COMPUTE = ["mem_bandwidth_gbps=1", "expert_gbps=0.5", "expert_overhead_ms=0.1",
           "sync_overhead_ms=0.2", "lazy_compute=true", "build_ms_per_layer=0.5"]


@pytest.fixture(scope="module")
def captured(tiny_random_converted, tmp_path_factory):
    """A small on-demand trace of tiny-random: one prompt, 8 decode tokens."""
    from engine.capture import capture, load_engine, start_recorder

    out = tmp_path_factory.mktemp("compare") / "trace"
    eng = load_engine(tiny_random_converted, preset="on-demand")
    rec = start_recorder(out, eng, command=["test"])
    try:
        capture(eng, ["def add(a, b):\n    return"], 9, recorder=rec)
    finally:
        rec.close()
        eng.close()
    return out


def test_cli_output_has_every_key(captured, ssdmoe):
    r = ssdmoe("sim", "compare", str(captured), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert list(out["metrics"]) == list(SUMMARY_KEYS)
    for key, row in out["metrics"].items():
        assert set(row) == {"measured", "simulated", "ratio", "error_pct"}, key
    m = out["metrics"]
    # the replay executes the trace's own routing: routing-derived figures agree exactly
    for key in ("loads_per_step", "mib_per_load", "mib_per_step", "adjacent_overlap",
                "load_entropy"):
        assert m[key]["simulated"] == pytest.approx(m[key]["measured"]), key
    assert m["decode_tok_s"]["measured"] > 0 and m["decode_tok_s"]["simulated"] > 0
    assert "path=exact" in out["settings"] and "readers=0" in out["settings"]
    table = ssdmoe("sim", "compare", str(captured))
    assert table.returncode == 0 and "simulated/measured" in table.stdout


def test_free_storage_gives_the_compute_bound_speed(captured):
    trace = read_trace(captured)
    result = compare(trace, sets=FREE_STORAGE + COMPUTE)
    sc = result.scenario
    m = sc.model
    layers, k = m.layers, sc.k
    attn = m.resident_bytes / layers / 1e9 * 1e3
    expert = 0.1 + k * m.bundle_bytes / 0.5e9 * 1e3
    # the exact path's zeroed stack for the K distinct experts, and the eval that runs it
    fill = k * m.bundle_bytes / (sc.hardware.zero_fill_gbps * 1e9) * 1e3 + 0.2
    assert sc.hardware.zero_fill_gbps > 0
    step_ms = layers * (0.5 + attn + expert + fill) + (layers + 1) * 0.2
    assert result.simulated["decode_tok_s"] == pytest.approx(1e3 / step_ms, rel=1e-5)
    assert result.simulated["blocked_ms_per_step"] == pytest.approx(0.0, abs=1e-5)
    assert result.ratio("decode_tok_s") == pytest.approx(
        result.simulated["decode_tok_s"] / result.measured["decode_tok_s"])


def test_engine_configs_map_onto_scenario_keys():
    m = model(layers=4, experts=16, k=2, bundle_bytes=1000)
    sc = scenario(m=m)
    sets, path, _ = engine_settings({"preset": "on-demand", "decode": "exact", "k": 2,
                                     "readers": 2, "o_direct": False}, sc)
    assert path == "exact" and sets == ["k=2", "path=exact", "lead=none", "lru_bytes=0",
                                        "readers=0", "lookahead=false",
                                        "prefill_stacks_held=false", "help_reads=true",
                                        "native_reads=false", "gil=true", "lora=false",
                                        "first_layer_hint=false", "o_direct=false"]
    sets, _, _ = engine_settings({"decode": "exact", "k": 2, "lora": "/some/adapter"}, sc)
    assert "lora=true" in sets
    sets, _, _ = engine_settings({"decode": "exact", "k": 2, "help_reads": False}, sc)
    assert "help_reads=false" in sets
    # who read: native threads (engine.native_reads) or Python ones, or a Python fallback
    for kind, native in (("native", "true"), ("python: native reads off", "false"), ("", "false")):
        sets, _, _ = engine_settings({"decode": "exact", "k": 2, "readers_kind": kind}, sc)
        assert f"native_reads={native}" in sets
    sets, _, _ = engine_settings({"decode": "hot", "k": 2, "readers": 3, "hot_bytes": None}, sc)
    assert "lru_bytes=16000" in sets and "readers=3" in sets  # 25% of 4 x 16 x 1000 bytes
    assert "prefill_stacks_held=false" in sets  # prefill exact (the config's default)
    sets, _, _ = engine_settings({"prefill": "whole-layer", "decode": "hot", "k": 2}, sc)
    assert "prefill_stacks_held=true" in sets  # the preset's whole-layer prefill keeps them
    sets, _, notes = engine_settings({"decode": "staged", "k": 2, "readers": 2,
                                      "staged_headroom": None,
                                      "o_direct_effective": True}, sc)
    assert sets[1:6] == ["path=staged", "lead=none", "staged_headroom=2", "readers=2",
                         "lru_bytes=0"]  # K + K slots per layer, no LRU behind them
    assert "o_direct=true" in sets and not notes  # the engine's slot tables, no stand-in
    sc.in_decode["build_ms_per_layer.hot"] = 0.42
    sc.in_decode["cold_overhead_ms.o_direct"] = 0.9
    sc.in_decode["cold_overhead_ms.in_decode"] = 0.6
    sc.in_decode["compute_factor"] = 1.2
    sets, _, _ = engine_settings({"decode": "hot", "k": 2}, sc)
    # buffered: the in-decode cold cost, not the O_DIRECT one
    assert sets[-3:] == ["build_ms_per_layer=0.42", "compute_factor=1.2", "cold_overhead_ms=0.6"]
    sets, _, _ = engine_settings({"decode": "hot", "k": 2, "o_direct": True}, sc)
    assert sets[-3:] == ["build_ms_per_layer=0.42", "compute_factor=1.2", "cold_overhead_ms=0.9"]
    # the device's latency inside decode: the device's, so buffered and O_DIRECT alike
    sc.in_decode["ssd_latency_ms.in_decode"] = 0.07
    for o_direct in (False, True):
        sets, _, _ = engine_settings({"decode": "hot", "k": 2, "o_direct": o_direct}, sc)
        assert "ssd_latency_ms=0.07" in sets
    # the lookahead loop's dispatch is fitted per path: each trace gets its own path's
    sc.in_decode["fill_ms_per_layer.hot"] = 0.05
    sc.in_decode["fill_ms_per_layer.staged"] = 0.16
    sets, _, _ = engine_settings({"decode": "hot", "k": 2}, sc)
    assert "fill_ms_per_layer=0.05" in sets and "fill_ms_per_layer=0.16" not in sets
    sets, _, _ = engine_settings({"decode": "staged", "k": 2}, sc)
    assert "fill_ms_per_layer=0.16" in sets and "fill_ms_per_layer=0.05" not in sets
    sets, _, _ = engine_settings({"decode": "exact", "k": 2}, sc)
    assert not any(s.startswith("fill_ms_per_layer") for s in sets)
    # the layer lead: the staged path's until it has its own, then its own (not the token
    # lead's, which shares the staged path's)
    layer = {"decode": "staged", "k": 2, "lead_kind": "layer"}
    sets, _, _ = engine_settings(layer, sc)
    assert "fill_ms_per_layer=0.16" in sets
    sc.in_decode["fill_ms_per_layer.staged-layer"] = 0.31
    sets, _, _ = engine_settings(layer, sc)
    assert "fill_ms_per_layer=0.31" in sets and "fill_ms_per_layer=0.16" not in sets
    sets, _, _ = engine_settings({"decode": "staged", "k": 2}, sc)
    assert "fill_ms_per_layer=0.16" in sets and "fill_ms_per_layer=0.31" not in sets
    with pytest.raises(BadInput, match="decode path 'fancy' unknown"):  # the contract's check
        engine_settings({"decode": "fancy"}, sc)


def test_page_cache_budget_becomes_the_simulated_page_cache(captured, tiny_random_converted,
                                                            tmp_path, monkeypatch):
    import shutil

    import numpy as np

    from engine.loader import open_manifest
    from engine.paths.kernel import alloc_stack, row_views
    from engine.store import ExpertStore
    from sim.compare import paged_bundle_bytes
    from sim.memory_budget import budget

    copy = tmp_path / "t"
    shutil.copytree(captured, copy)
    run = json.loads((copy / "run.json").read_text())
    bundle = run["model"]["bundle_bytes"]
    run["engine"]["page_cache_budget"] = 40 * bundle
    (copy / "run.json").write_text(json.dumps(run))
    # what the engine's budget really charges per bundle: read every bundle of layer 0
    manifest = open_manifest(tiny_random_converted, verify=False)
    layer = manifest.moe_layers[0]
    with ExpertStore(manifest, page_cache_budget=1 << 40) as store:
        _, views = alloc_stack(store.expert_shapes(layer), 1)
        for e in range(manifest.num_experts):
            store.read_bundle(layer, e, row_views(views, 0), emit=False)
        charged = store.budget.used_bytes / manifest.num_experts
    paged = paged_bundle_bytes(read_trace(copy))
    assert paged == pytest.approx(charged) and paged >= bundle
    held = int(40 * bundle // paged)
    sc, derived, _ = scenario_for(read_trace(copy))
    assert budget(sc).page_cache == pytest.approx(held * bundle, abs=2)
    assert f"page cache = {40 * bundle} bytes" in derived
    result = compare(read_trace(copy))
    assert result.extra["page_cache_capacity_bytes"] == held * bundle  # a Comparison: JSON
    assert np.isfinite(result.simulated["decode_tok_s"])
    # the trace moved to another machine (its model directory gone): the model profile's
    # page-rounded bundle (from the same manifest) gives the same page cache, not a warmer one
    with_manifest = scenario_for(read_trace(copy))[0].model
    run["model"]["path"] = str(tmp_path / "gone")
    (copy / "run.json").write_text(json.dumps(run))
    monkeypatch.setattr("sim.compare.trace_model", lambda trace, notes: with_manifest)
    assert paged_bundle_bytes(read_trace(copy)) is None
    moved, _, _ = scenario_for(read_trace(copy))
    assert budget(moved).page_cache == pytest.approx(held * bundle, abs=2)


def test_trace_without_a_model_profile_is_bad_input(captured, tmp_path):
    import shutil

    copy = tmp_path / "t"
    shutil.copytree(captured, copy)
    run = json.loads((copy / "run.json").read_text())
    run["model"]["path"] = str(tmp_path / "gone")
    run["model"]["name"] = "no-such-model"
    (copy / "run.json").write_text(json.dumps(run))
    with pytest.raises(BadInput, match="no model profile for model 'no-such-model'"):
        compare(read_trace(copy))


def test_the_budgets_page_drops_cost_per_page(captured, tmp_path):
    """Under the engine's page-cache budget, each evicted bundle's drop costs what validate
    fitted inside decode plus its pages x the kernel's per-page drop (hardware
    page_drop_us_per_page): a bundle twice as large costs twice the per-page part."""
    import shutil

    from sim.compare import paged_bundle_bytes

    copy = tmp_path / "t"
    shutil.copytree(captured, copy)
    assert scenario_for(read_trace(copy))[0].budget_evict_ms == 0.0  # no budget: no drops
    run = json.loads((copy / "run.json").read_text())
    run["engine"]["page_cache_budget"] = 40 * run["model"]["bundle_bytes"]
    (copy / "run.json").write_text(json.dumps(run))
    trace = read_trace(copy)
    pages = -(-int(round(paged_bundle_bytes(trace))) // 4096)
    fitted = float(scenario_for(trace)[0].in_decode.get("budget_evict_ms.in_decode", 0.0))
    sc, _, _ = scenario_for(trace, sets=["page_drop_us_per_page=2"])
    assert sc.budget_evict_ms == pytest.approx(fitted + pages * 2 / 1e3)
    sc, _, _ = scenario_for(trace, sets=["page_drop_us_per_page=0"])
    assert sc.budget_evict_ms == pytest.approx(fitted)
