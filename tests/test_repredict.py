"""reports/cross-machine/repredict.py: the error summary by hand, and a committed run
re-predicted end to end (its held-out configurations replayed on its own profiles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reports.load_script import load_script

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "reports" / "cross-machine" / "b-validation-6"


def _script():
    return load_script("cross-machine/repredict.py")


def test_errors_by_hand():
    """Decode 100 -> 110, 50 -> 40, 20 -> 28: 10%, 20%, 40% off; median 20, p90 (linear
    between ranks, as validation.report) 20 + 0.8 x 20 = 36. A figure measured as 0 is left
    out."""
    rp = _script()
    keys = rp.FIGURES
    m = [dict.fromkeys(keys, v) for v in (100.0, 50.0, 20.0)]
    s = [dict.fromkeys(keys, v) for v in (110.0, 40.0, 28.0)]
    m[0]["eval_ms_per_step"] = 0.0
    e = rp.errors(list(zip(m, s, strict=True)))
    assert e["decode_tok_s"] == pytest.approx({"median_pct": 20.0, "p90_pct": 36.0})
    assert e["eval_ms_per_step"] == pytest.approx({"median_pct": 30.0, "p90_pct": 38.0})


@pytest.mark.skipif(not (RUN / "results").is_dir(), reason="no committed run")
def test_a_committed_run_repredicts(tmp_path):
    """One held-out configuration of b-validation-6 replayed: a throttled one, which the
    simulator gets within a few percent (its README: 15 MB/s on demand)."""
    import json

    rp = _script()
    d = json.loads((RUN / "results" / "on-demand-pc25-15mbps.json").read_text())
    scenario = rp.scenario_file((RUN / "profiles").resolve(), tmp_path)
    sim = rp.simulated_figures(ROOT / d["trace"], scenario, tmp_path / "sim")
    assert sim["decode_tok_s"] == pytest.approx(d["measured"]["decode_tok_s"], rel=0.1)
    assert sim["build_ms_per_step"] > 0 and sim["eval_ms_per_step"] > 0
