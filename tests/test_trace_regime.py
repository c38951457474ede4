"""`trace summary` flags a trace whose decode routing repeats far more than the model's
held-out text (traces.regime), on the hand-made trace whose decode overlap is 0.75 by hand."""

from __future__ import annotations

import json

from trace_handmade import write_handmade

from traces.reader import read_trace
from traces.regime import MARGIN, regime


def _trace_with_model(tmp_path, heldout: float | None):
    trace_dir = write_handmade(tmp_path / "t")
    model = tmp_path / "model"
    model.mkdir()
    if heldout is not None:
        (model / "fixture.json").write_text(json.dumps(
            {"heldout": {"adjacent_overlap_mean": heldout}}))
    run = json.loads((trace_dir / "run.json").read_text())
    run["model"]["path"] = str(model)
    (trace_dir / "run.json").write_text(json.dumps(run))
    return trace_dir


def test_flags_repetitive_decode(tmp_path, ssdmoe):
    d = _trace_with_model(tmp_path, 0.16)
    r = regime(read_trace(d), 0.75)
    assert r.repetitive and "0.75 vs 0.16" in r.warning()
    out = ssdmoe("trace", "summary", str(d))
    assert out.returncode == 0 and "decode routing repeats" in out.stdout
    js = ssdmoe("trace", "summary", str(d), "--json")
    assert "decode routing repeats" in js.stderr and json.loads(js.stdout)["adjacent_overlap"] \
        == 0.75


def test_no_flag_within_margin_or_without_figure(tmp_path, ssdmoe):
    near = _trace_with_model(tmp_path / "a", 0.75 - MARGIN + 0.01)
    assert not regime(read_trace(near), 0.75).repetitive
    assert "repeats" not in ssdmoe("trace", "summary", str(near)).stdout
    none = _trace_with_model(tmp_path / "b", None)
    assert regime(read_trace(none), 0.75).warning() is None
