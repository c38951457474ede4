"""Policies: where demand loads can and cannot appear, and prediction accuracy."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from sim_helpers import hardware, model, routing_input, scenario, uniform_routing

from sim.policies import perturb
from sim.replay import run_scenario

# 6 layers, consumers 2-5 (heads owned by 1-4), 32 experts, K=2
M = dict(layers=6, experts=32, k=2, consumer_first=2, consumer_last=5, heads=4,
         head_bytes=0, build_ms_per_layer=0.5)


def _run(router, predicted=None, **over):
    sc = scenario(hw=hardware(mem_bandwidth_gbps=1e9), m=model(**M), decode_steps=len(router),
                  **over)
    return run_scenario(sc, routing=routing_input(router, predicted))


def _lead(arm: str) -> dict:
    """"token" or "layer:N" as scenario keys."""
    lead, _, layers = arm.partition(":")
    return {"lead": lead, **({"lead_layers": int(layers)} if layers else {})}


def _demand_layers(result) -> set[int]:
    loads = result.trace.loads.filter(pl.col("source") == "demand")
    return set(loads["layer"].to_list())


def test_perturb_keeps_sets_and_hits_the_accuracy():
    router = uniform_routing(4000, 3, 64, 4, seed=1)
    pred = perturb(router, 0.6, 64, seed=2)
    assert all(len(set(row)) == 4 for row in pred.reshape(-1, 4).tolist())  # still sets
    hits = (pred[..., :, None] == router[..., None, :]).any(-1).mean()
    assert hits == pytest.approx(0.6, abs=0.01)
    assert np.array_equal(perturb(router, 1.0, 64, seed=2), router)


def test_prediction_as_routing_never_loads_on_demand_in_consumer_layers():
    router = uniform_routing(300, 6, 32, 2, seed=3)
    predicted = perturb(router, 0.3, 32, seed=4)  # bad predictions: still executed, no fallback
    result = _run(router, predicted, lead="token")
    assert _demand_layers(result) == {0, 1}
    prefetch = result.trace.loads.filter(pl.col("source") == "prefetch")
    assert set(prefetch["layer"].to_list()) == {2, 3, 4, 5}
    executed = result.trace.routing.filter(pl.col("layer") == 3).sort("step")
    assert executed["experts"].to_list() == predicted[:, 3].tolist()
    assert executed["router_experts"].to_list() == router[:, 3].tolist()


@pytest.mark.parametrize("lead", ["token", "layer:1", "layer:2"])
def test_speculative_prefetch_falls_back_to_demand_loads_only_when_wrong(lead):
    router = uniform_routing(300, 6, 32, 2, seed=5)
    exact = _run(router, router, **_lead(lead), prediction_is_routing=False)
    assert _demand_layers(exact) <= {0, 1}  # every consumer's routed set was staged
    wrong = _run(router, perturb(router, 0.5, 32, seed=6), **_lead(lead),
                 prediction_is_routing=False)
    assert _demand_layers(wrong) & {2, 3, 4, 5}  # mispredicted experts became demand loads
    executed = wrong.trace.routing.filter(pl.col("layer") == 4).sort("step")
    assert executed["experts"].to_list() == router[:, 4].tolist()  # the router decides


def test_lookahead_accuracy_from_parameter_when_the_trace_has_none():
    router = uniform_routing(400, 6, 32, 2, seed=7)
    demand = []
    for accuracy in (1.0, 0.7, 0.3):
        result = _run(router, None, lead="layer", lead_layers=1, prediction_is_routing=False,
                      prediction_accuracy=accuracy, seed=1)
        loads = result.trace.loads
        demand.append(loads.filter((pl.col("source") == "demand") & (pl.col("layer") >= 2))
                      .height)
    assert demand[0] == 0 and demand[0] < demand[1] < demand[2]
