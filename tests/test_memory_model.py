"""The simulator's engine memory against the engine's own allocation: what MLX holds after an
engine of each configuration is built (mx.get_active_memory), beyond the on-demand engine's,
equals what sim.memory_budget counts beyond it: the hot pool, the staged slots, and the two
full-layer stacks the whole-layer prefill path keeps for the engine's life."""

from __future__ import annotations

import gc

import pytest

from advise.machine import Machine
from advise.space import Candidate


def _held(model, cfg) -> int:
    import mlx.core as mx

    from engine.loader import load_streaming

    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    engine = load_streaming(model, config=cfg)
    after = mx.get_active_memory()
    engine.close()
    del engine
    gc.collect()
    mx.clear_cache()
    return after - before


def test_engine_memory_per_configuration_is_the_simulators(tiny_random_converted):
    from advise.model import load_model
    from advise.predict import Setting, scenario
    from sim.memory_budget import budget

    model = load_model(str(tiny_random_converted))
    setting = Setting(model, Machine(), prompt_tokens=8, decode_steps=10)
    expert = model.expert_bytes
    cands = {"on-demand": Candidate("on-demand", model.k),
             "staged": Candidate("staged", model.k, headroom=model.k, readers=2,
                                 cache_policy="lru"),
             "staged, headroom 2K": Candidate("staged", model.k, headroom=2 * model.k,
                                              readers=2, cache_policy="lru"),
             "hot 50%": Candidate("hot", model.k, hot_fraction=0.5, readers=2,
                                  cache_policy="lru")}
    measured, simulated = {}, {}
    for name, c in cands.items():
        measured[name] = _held(tiny_random_converted, c.engine_config(expert, None, None))
        simulated[name] = budget(scenario(setting, c)).engine
    stacks = 2 * model.experts * model.bundle_bytes
    assert simulated["staged"] - simulated["on-demand"] >= stacks  # the stacks are counted
    for name in cands:
        got = measured[name] - measured["on-demand"]
        want = simulated[name] - simulated["on-demand"]
        assert got == pytest.approx(want, rel=0.05, abs=64 * 1024), name
