"""EngineConfig: presets, per-layer/per-phase choice, to_dict round trip, validation, and the
`generate --preset` option (same tokens for every preset)."""

from __future__ import annotations

import json

import pytest

from contract.engine_config import PRESETS, EngineConfig
from contract.errors import BadInput
from engine.loader import load_streaming
from engine.paths.exact import ExactPath
from engine.paths.hot import HotPath
from engine.paths.staged import StagedPath
from engine.paths.whole_layer import WholeLayerPath


def test_presets_and_round_trip():
    assert {"on-demand", "hot", "staged"} <= set(PRESETS)
    c = EngineConfig.from_preset("staged", readers=3, layers={2: {"decode": "hot"}})
    assert (c.preset, c.prefill, c.decode, c.readers) == ("staged", "whole-layer", "staged", 3)
    assert c.path_for(2, "decode") == "hot" and c.path_for(2, "prefill") == "whole-layer"
    assert c.path_for(0, "decode") == "staged"
    d = json.loads(json.dumps(c.to_dict()))
    assert EngineConfig.from_dict(d) == c
    assert d["prerouter"] is None and d["lead"] == 0
    on = EngineConfig.from_preset("on-demand")
    assert (on.prefill, on.decode) == ("exact", "exact")


@pytest.mark.parametrize("kwargs,match", [
    ({"decode": "fast"}, "decode path 'fast' unknown"),
    ({"layers": {1: {"decode": "nope"}}}, "layer 1 decode path 'nope'"),
    ({"layers": {1: {"middle": "exact"}}}, "unknown phase 'middle'"),
    ({"readers": 0}, "readers .* must be an integer from 1 to 64, got 0"),
    ({"readers": 65}, "readers .* must be an integer from 1 to 64, got 65"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(BadInput, match=match):
        EngineConfig(**kwargs)
    with pytest.raises(BadInput, match="unknown"):
        EngineConfig.from_preset("turbo")


def test_runtime_builds_paths_per_layer_and_phase(tiny_random_converted):
    config = EngineConfig.from_preset("staged", layers={0: {"decode": "hot"},
                                                        3: {"prefill": "exact"}})
    eng = load_streaming(tiny_random_converted, config=config)
    store = eng.store
    rt = eng.runtime
    assert rt.config is config
    assert isinstance(rt.path(0, "decode"), HotPath)
    assert isinstance(rt.path(1, "decode"), StagedPath)
    assert isinstance(rt.path(1, "prefill"), WholeLayerPath)
    assert isinstance(rt.path(3, "prefill"), ExactPath)
    assert rt.path(2, "prefill").next_layer is None  # layer 3 does not read whole layers
    assert rt.path(1, "prefill").next_layer == 2
    assert set(rt.staged()) == {1, 2, 3}
    assert rt.buffer_bytes()["whole_layer"] == 2 * store.manifest.num_experts * \
        store.manifest.bundle_bytes
    with pytest.raises(BadInput, match="layer 9 is not a MoE layer"):
        load_streaming(tiny_random_converted, config=EngineConfig(layers={9: {"decode": "hot"}}))
    eng.close()


def test_cli_generate_preset_same_tokens(tiny_random_converted, ssdmoe):
    outs = {}
    for preset in ("on-demand", "hot", "staged"):
        r = ssdmoe("generate", str(tiny_random_converted), "--prompt", "def f(x):",
                   "--max-tokens", "12", "--preset", preset, "--json")
        assert r.returncode == 0, r.stderr
        outs[preset] = json.loads(r.stdout)["tokens"]
    assert outs["hot"] == outs["on-demand"] == outs["staged"]
    r = ssdmoe("generate", str(tiny_random_converted), "--prompt", "x", "--preset", "turbo")
    assert r.returncode == 2 and "--preset 'turbo': unknown" in r.stderr
