"""Every execution path (exact, hot, staged, whole-layer) computes the same numbers: element-wise
equal to the exact path, within 1% (relative L2) of a float64 dequantized reference, and any
per-layer / per-phase mix gives the same greedy tokens and the same logits as the resident
model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from dequant_reference import swiglu_reference
from layer_reference import stacked_reference

from contract.engine_config import EngineConfig
from engine.generate import generate
from engine.loader import load_resident, load_streaming
from engine.manifest import read_manifest
from engine.paths.exact import ExactPath
from engine.paths.hot import HotPath, HotPool
from engine.paths.staged import StagedPath
from engine.paths.stats import PathStats
from engine.paths.whole_layer import WholeLayerLoader, WholeLayerPath
from engine.readers import ReaderPool
from engine.store import ExpertStore

PROMPT = "Streaming experts from disk, one layer at a time: def f(x): return x"




def _paths(store, layer, readers, stats):
    pool = HotPool(store, readers, stats, 6 * store.manifest.bundle_bytes)
    loader = WholeLayerLoader(store, readers, stats)
    return {"hot": HotPath(store, layer, pool),
            "staged": StagedPath(store, layer, readers, stats),
            "whole-layer": WholeLayerPath(store, layer, loader)}


@pytest.mark.parametrize("fixture", ["tiny_random_converted", "tiny_grouped_converted"])
def test_paths_equal_exact_and_reference(fixture, request):
    root = request.getfixturevalue(fixture)
    m = read_manifest(root)
    rng = np.random.default_rng(0)
    with ExpertStore(m) as store:
        stats = PathStats()
        readers = ReaderPool(store, 2, stats)
        layer = m.moe_layers[-1]
        ref_tensors = stacked_reference(root / m.layers[layer].file)
        paths = _paths(store, layer, readers, stats)
        # single tokens (decode, several calls so slots and LRU rows get reused), then 40
        for tokens in (1, 1, 1, 1, 1, 40):
            x = rng.standard_normal((tokens, m.config["hidden_size"])).astype(np.float32)
            inds = np.stack([rng.choice(m.num_experts, m.top_k, replace=False)
                             for _ in range(tokens)]).astype(np.uint32)
            exact = np.array(ExactPath(store, layer)(mx.array(x), mx.array(inds)))
            ref = swiglu_reference(x.astype(np.float64), inds, ref_tensors)
            for name, path in paths.items():
                y = np.array(path(mx.array(x), mx.array(inds)))
                assert np.array_equal(y, exact), (name, tokens)
                rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
                assert rel < 0.01, (name, tokens, rel)
        readers.close()


def _mixed(bundle: int) -> EngineConfig:
    return EngineConfig(prefill="whole-layer", decode="staged", hot_bytes=5 * bundle, layers={
        0: {"prefill": "exact", "decode": "hot"},
        1: {"decode": "exact"},
        2: {"prefill": "staged", "decode": "whole-layer"},
    })


CONFIGS = {
    "on-demand": lambda b: EngineConfig.from_preset("on-demand"),
    "hot": lambda b: EngineConfig.from_preset("hot"),
    "staged": lambda b: EngineConfig.from_preset("staged"),
    "staged-h0": lambda b: EngineConfig.from_preset("staged", staged_headroom=0, readers=1),
    "hot-min": lambda b: EngineConfig.from_preset("hot", hot_bytes=4 * b),  # exactly K bundles
    "mixed": _mixed,
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_presets_and_mixes_same_tokens_as_resident(name, tiny_random_converted):
    from mlx_lm.generate import generate_step

    rm, tok = load_resident(tiny_random_converted)
    ids = tok.encode(PROMPT)
    ref = [t for t, _ in generate_step(mx.array(ids), rm, max_tokens=24)]
    config = CONFIGS[name](read_manifest(tiny_random_converted).bundle_bytes)
    eng = load_streaming(tiny_random_converted, config=config)
    model, tok = eng.model, eng.tokenizer
    # logits of a multi-token forward (prefill paths) equal the resident model's
    x = mx.array(ids)[None]
    assert np.array_equal(np.array(model(x)), np.array(rm(x)))
    for _ in range(2):  # second request reuses warm slots / LRU rows
        r = generate(model, tok, ids, 24, stop_at_eos=False, prefill_step_size=7,
                     runtime=eng.runtime)
        assert r.tokens == ref
    eng.close()


@pytest.mark.parametrize("preset", ["hot", "staged"])
def test_grouped_routing_presets_same_tokens(preset, tiny_grouped_converted):
    """sigmoid-group routing, a dense first layer and a shared expert (bailing_moe)."""
    eng = load_streaming(tiny_grouped_converted)
    model, tok = eng.model, eng.tokenizer
    ref = generate(model, tok, PROMPT, 16, stop_at_eos=False, runtime=eng.runtime).tokens
    eng.close()
    eng = load_streaming(tiny_grouped_converted, config=EngineConfig.from_preset(preset))
    model, tok = eng.model, eng.tokenizer
    assert generate(model, tok, PROMPT, 16, stop_at_eos=False, runtime=eng.runtime).tokens == ref
    eng.close()
