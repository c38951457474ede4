"""Replay: traces in, simulated traces out; prefill by hand; a paper-scale run completes."""

from __future__ import annotations

import polars as pl
import pytest
from sim_helpers import MB, hardware, model, routing_input, scenario, uniform_routing

from contract.errors import BadInput
from sim.profiles import load_scenario
from sim.replay import run_scenario, write_trace
from sim.routing_synth import SynthRouting, synthetic_trace
from traces.reader import read_trace


def test_replaying_a_simulated_trace_reproduces_it(tmp_path):
    m = model(layers=3, experts=32, k=2)
    sc = scenario(m=m, path="staged", decode_steps=200, lru_bytes=8 * MB)
    first = run_scenario(sc, routing=routing_input(uniform_routing(200, 3, 32, 2, seed=4)),
                         out=tmp_path / "a")
    again = run_scenario(sc, trace=read_trace(tmp_path / "a"))
    assert again.metrics == first.metrics
    assert again.trace.loads.equals(first.trace.loads)


def test_trace_with_predictions_replays_them_as_routing(tmp_path):
    m = model(layers=4, experts=32, k=2, consumer_first=1, consumer_last=3, heads=3)
    params = SynthRouting(layers=4, experts=32, k=2, steps=100, reuse=0.3,
                          prediction_accuracy=0.5, predicted_layers=[1, 2, 3], seed=3)
    trace = synthetic_trace(params, bundle_bytes=MB)
    write_trace(trace, tmp_path / "t")
    result = run_scenario(scenario(m=m, lead="token"), trace=read_trace(tmp_path / "t"))
    sim_routing = result.trace.routing.sort("step", "layer")
    src = trace.routing.sort("step", "layer")
    assert sim_routing["experts"].to_list() == src["experts"].to_list()
    assert sim_routing["source"].to_list() == src["source"].to_list()
    on_demand = run_scenario(scenario(m=m, path="staged"), trace=read_trace(tmp_path / "t"))
    assert on_demand.trace.routing.sort("step", "layer")["experts"].to_list() == \
        src["router_experts"].to_list()  # without the prerouter each router decides


def test_trace_that_does_not_match_the_model_is_bad_input():
    trace = synthetic_trace(SynthRouting(layers=4, experts=32, k=2, steps=10), bundle_bytes=MB)
    with pytest.raises(BadInput, match="model.layers=4 but model profile"):
        run_scenario(scenario(m=model(layers=3, experts=32, k=2)), trace=trace)
    with pytest.raises(BadInput, match="set k=2"):
        run_scenario(scenario(m=model(layers=4, experts=32, k=2), k=4), trace=trace)


def test_prefill_whole_layer_loads_overlap_compute_by_hand():
    # 2 layers x 8 experts of 1 MiB; whole-layer read: 9 requests x 0.1 ms latency + 8 MiB / 1 GB/s
    # + 9 x 0.2 ms CPU; prefill compute per layer c = T * 2 * active / layers / flops.
    m = model(layers=2, experts=8, k=2, active_params=1e9, build_ms_per_layer=1.0)
    hw = hardware(ssd_latency_ms=0.1, ssd_bandwidth_gbps=1.0, load_overhead_ms=0.2,
                  compute_tflops=1.0, mem_bandwidth_gbps=1e9)
    T = 100
    w = 9 * 0.1e-3 + 8 * MB / 1e9 + 9 * 0.2e-3
    c = T * 2 * 1e9 / 2 / 1e12
    b = 1e-3
    assert c > w + b  # compute-bound: layer 1's load hides under layer 0's compute
    sc = scenario(hw=hw, m=m, path="staged", prefill_tokens=T, decode_steps=5)
    result = run_scenario(sc)  # synthetic routing: one prefill step, then 5 decode steps
    # load 0 (main, w), build 0, compute 0 queued; load 1 (main, w) and build 1 under it;
    # compute 1 starts when compute 0 ends
    step = w + b + 2 * c
    assert result.metrics["prefill_tok_s"] == pytest.approx(T / step, rel=1e-6)
    loads = result.trace.loads.filter(pl.col("source") == "whole_layer")
    assert loads["expert"].to_list() == [-1, -1] and loads["cold"].to_list() == [True, True]
    # every bundle is now in the page cache: decode reads are all warm
    decode = result.trace.steps.filter(pl.col("phase") == "decode")
    assert decode["loads"].sum() > 0 and decode["cold_loads"].sum() == 0


def test_thousand_decode_steps_of_edge0_35b_complete_with_every_layers_routing():
    """A paper-scale run completes: 1,000 decode steps x 40 layers of routing at K=4. (Its speed
    target, <= 5 s, is a benchmark: reports/sim/speed.py, not a timed test.)"""
    for lead in ("none", "token"):
        sc = load_scenario("paper-m2-16gb", ["decode_steps=1000", f"lead={lead}"])
        assert sc.model.layers == 40 and sc.k == 4
        result = run_scenario(sc)
        assert result.figures.decode_steps == 1000
        steps = result.trace.steps.filter(pl.col("phase") == "decode")
        assert steps.height == 1000 and (steps["end_ns"] > steps["start_ns"]).all()
        routing = result.trace.routing
        assert routing.height == 1000 * 40
        per_step = routing.group_by("step").agg(pl.col("layer").n_unique().alias("layers"),
                                                pl.len().alias("rows"))
        assert per_step.height == 1000
        assert set(per_step["layers"]) == {40} and set(per_step["rows"]) == {40}
        assert set(routing["experts"].list.unique().list.len()) == {4}  # K distinct experts
        loads = result.trace.loads
        assert loads.height > 0 and loads["step"].max() <= steps["step"].max()


def test_the_simulator_never_imports_mlx():
    import subprocess
    import sys

    code = ("import sys, sim.replay, sim.profiles, ssdmoe_cli.sim_cmds; "
            "from sim.profiles import load_scenario; from sim.replay import run_scenario; "
            "run_scenario(load_scenario('paper-m2-16gb', ['decode_steps=3'])); "
            "bad = [m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
