"""reports/io/token-lead/run.py's figures of a trace, on the hand-made trace
(tests/trace_handmade.py): decode steps 1, 2, 3, 5, 6 over 10 + 20 + 30 + 40 + 50 ms; the
waits by layer, the cold loads by layer, and how far ahead of a step's first on-demand load
its prefetches start."""

from __future__ import annotations

import pytest
from trace_handmade import write_handmade

from reports.load_script import load_script
from traces.reader import read_trace


def _script(name: str):
    """reports/io/token-lead/NAME.py as a module (the folder's name is not an identifier)."""
    return load_script(f"io/token-lead/{name}.py")


@pytest.fixture(scope="module")
def report():
    return _script("run")


def test_lead_figures_by_hand(report, tmp_path):
    """Layer 0 waited 2 (step 1) + 6 (step 5) ms, layer 1 4 (step 2) + 8 (step 6): 1.6 and 2.4
    ms a step over 5 decode steps, 4.0 in all (the steps' own blocked column says 20 / 5 = 4).
    Cold loads: layer 0 in steps 1, 2, 5; layer 1 twice in step 2 and once in step 5: 0.6 each.
    Only step 5 has prefetches (first issued at 65 ms) and an on-demand load (90 ms): a lead of
    25 ms. The prefill step's whole-layer loads are left out."""
    f = report.lead_figures(read_trace(write_handmade(tmp_path / "t")))
    assert f["decode_tok_s"] == pytest.approx(5 / 0.150)
    assert f["blocked_ms_per_step"] == pytest.approx(4.0)
    assert f["blocked_ms_by_layer"] == pytest.approx({0: 1.6, 1: 2.4})
    assert f["cold_loads_by_layer"] == pytest.approx({0: 0.6, 1: 0.6})
    assert f["issue_lead_ms"] == pytest.approx(25.0)


@pytest.fixture(scope="module")
def probe():
    return _script("first_layer_probe")


def test_first_layer_probe_recall_and_fit_by_hand(probe):
    """Top-2 of [3, 2, 1, 0] is {0, 1}, of [0, 1, 2, 3] {3, 2}; the routed sets {0, 1} and
    {0, 1}: recall (2/2 + 0/2) / 2. A ridge fit of y = 2x - 1 with a tiny lambda predicts it."""
    import numpy as np

    scores = np.array([[3.0, 2, 1, 0], [0, 1, 2, 3]])
    routed = np.array([[3.0, 2, 0, 1], [3, 2, 1, 0]])
    assert probe.recall_at_k(scores, routed, 2) == pytest.approx(0.5)
    assert probe.recall_at_k(routed, routed, 3) == pytest.approx(1.0)
    x = np.arange(10.0)[:, None]
    got = probe.ridge(x, 2 * x - 1, np.array([[20.0]]), lam=1e-9)
    assert got[0, 0] == pytest.approx(39.0, rel=1e-6)


def _hint_script():
    return load_script("io/first-layer-hint/run.py")


def test_first_layer_hint_report_by_hand(tmp_path):
    """reports/io/first-layer-hint/run.py: the hand-made trace's cold prefetches in decode are
    expert 3 of layer 0 (issued and started at 65 ms, done at 82) and expert 1 of layer 1 (67,
    67, 75): from issue to start 0 ms, start to finish the median of 17 and 8. The paired gain
    of rounds (110 over 100, 90 over 100, 105 over 100) is their median ratio, 1.05."""
    hint = _hint_script()
    times = hint.read_times(write_handmade(tmp_path / "t"))
    assert times == pytest.approx({"queue_ms": 0.0, "service_ms": 12.5})
    rounds = [{"decode_tok_s": v} for v in (110.0, 90.0, 105.0)]
    assert hint.paired_gain(rounds, [{"decode_tok_s": 100.0}] * 3) == pytest.approx(1.05)
