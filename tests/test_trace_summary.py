"""summarize / summarize_layers against numbers worked out by hand (see trace_handmade.py)."""

from __future__ import annotations

import math

import polars as pl
import pytest
from trace_handmade import MS, write_handmade

from traces.reader import Trace, read_trace
from traces.schema import SUMMARY_KEYS
from traces.summary import summarize, summarize_layers


def _h(*p: float) -> float:
    """Normalised entropy of a distribution over 4 experts, written out."""
    return -sum(x * math.log(x) for x in p) / math.log(4)


@pytest.fixture
def trace(tmp_path) -> Trace:
    return read_trace(write_handmade(tmp_path / "t"))


def test_summary_matches_hand_worked_values(trace):
    s = summarize(trace)
    assert tuple(s) == SUMMARY_KEYS
    expected = {
        "decode_tok_s": 5 / 0.150,  # 5 decode tokens over 10+20+30+40+50 ms
        "prefill_tok_s": 10 / 0.005,  # 6 + 4 tokens over 3 + 2 ms
        "step_ms_p10": 14.0,  # linear interpolation in [10, 20, 30, 40, 50]
        "step_ms_p50": 30.0,
        "step_ms_p90": 46.0,
        "blocked_ms_per_step": (2 + 4 + 0 + 6 + 8) / 5,
        "loads_per_step": (2 + 3 + 0 + 4 + 1) / 5,
        "mib_per_load": 10.5 / 10,
        "cold_fraction": 6 / 10,
        "mib_per_step": 10.5 / 5,
        # layer 0: pairs 1/2, 1, 1 (request 1's first token is not paired with request 0's)
        # layer 1: pairs 0, 1, 1
        "adjacent_overlap": ((0.5 + 1 + 1) / 3 + (0 + 1 + 1) / 3) / 2,
        "load_entropy": (_h(0.3, 0.3, 0.2, 0.2) + _h(0.2, 0.4, 0.1, 0.3)) / 2,
        "peak_mlx_bytes": 1000,  # a prefill step holds the peak; -1 means unknown
        "peak_rss_bytes": 7000,
    }
    for key, want in expected.items():
        assert s[key] == pytest.approx(want, rel=1e-12), key
    assert isinstance(s["peak_mlx_bytes"], int) and isinstance(s["peak_rss_bytes"], int)


def test_layers_table_matches_hand_worked_values(trace):
    layers = summarize_layers(trace)
    assert layers["layer"].to_list() == [0, 1]
    assert layers["tokens"].to_list() == [5, 5]
    assert layers["adjacent_overlap"].to_list() == pytest.approx([2.5 / 3, 2 / 3])
    assert layers["load_entropy"].to_list() == pytest.approx(
        [_h(0.3, 0.3, 0.2, 0.2), _h(0.2, 0.4, 0.1, 0.3)])
    assert layers["loads"].to_list() == [4, 6]  # decode loads only (no whole-layer prefill)
    assert layers["loads_per_step"].to_list() == pytest.approx([0.8, 1.2])
    assert layers["cold_fraction"].to_list() == pytest.approx([3 / 4, 3 / 6])
    assert layers["wait_ms_per_step"].to_list() == pytest.approx([(2 + 6) / 5, (4 + 8) / 5])


def _with_steps(trace: Trace, steps: pl.DataFrame) -> Trace:
    return Trace(trace.path, trace.run, steps, trace.routing, trace.loads)


def test_simulated_trace_without_memory_or_prefill(trace):
    """What the simulator writes: reader-N threads, no MLX/RSS figures, maybe no prefill."""
    steps = trace.steps.filter(pl.col("phase") == "decode").with_columns(
        pl.lit(None, dtype=pl.Int64).alias("mlx_active_bytes"),
        pl.lit(-1, dtype=pl.Int64).alias("mlx_peak_bytes"),
        pl.lit(None, dtype=pl.Int64).alias("rss_bytes"),
    )
    s = summarize(_with_steps(trace, steps))
    assert s["prefill_tok_s"] is None
    assert s["peak_mlx_bytes"] is None and s["peak_rss_bytes"] is None
    assert s["decode_tok_s"] == pytest.approx(5 / 0.150)
    assert s["adjacent_overlap"] == pytest.approx(0.75)


def test_empty_trace_gives_none_everywhere(trace):
    empty = Trace(trace.path, trace.run, trace.steps.clear(), trace.routing.clear(),
                  trace.loads.clear())
    assert summarize(empty) == dict.fromkeys(SUMMARY_KEYS)
    assert summarize_layers(empty).height == 0


def test_no_n_experts_means_no_entropy(trace):
    run = {**trace.run, "model": {}}
    s = summarize(Trace(trace.path, run, trace.steps, trace.routing, trace.loads))
    assert s["load_entropy"] is None
    assert s["adjacent_overlap"] == pytest.approx(0.75)


def test_single_decode_step_has_no_overlap(trace):
    steps = trace.steps.filter(pl.col("step") <= 1)
    s = summarize(_with_steps(trace, steps))
    assert s["adjacent_overlap"] is None
    assert s["step_ms_p50"] == pytest.approx(10.0)
    assert s["decode_tok_s"] == pytest.approx(1 / (10 * MS / 1e9))


def test_duplicate_routing_rows_are_bad_input(trace):
    from contract.errors import BadInput

    routing = pl.concat([trace.routing, trace.routing.filter(pl.col("step") == 2)])
    with pytest.raises(BadInput, match="routing.parquet: several rows for step 2"):
        summarize(Trace(trace.path, trace.run, trace.steps, routing, trace.loads))
