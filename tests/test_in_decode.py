"""sim.in_decode: the figures validate fits inside decode, read once from a scenario's
[in_decode] table and handed to a replay by its engine configuration (hand-worked)."""

from __future__ import annotations

import tomllib

import pytest

from contract.errors import BadInput
from sim.in_decode import InDecode, is_fitted

FITS = {"build_ms_per_layer.exact": 0.4, "build_ms_per_layer.staged": 0.2,
        "fill_ms_per_layer.staged": 0.16, "fill_ms_per_layer.staged-layer": 0.31,
        "compute_factor": 1.01, "cold_overhead_ms.in_decode": 0.05,
        "cold_overhead_ms.o_direct": 0.03, "head_build_ms.in_decode": 0.002,
        "cold_fill_compute_ms.in_decode": 0.04, "cold_fill_compute_ms.sync": 0.18,
        "budget_evict_ms.in_decode": 0.03, "dispatch_cpu_ms_per_layer.in_decode": 0.45}


def test_each_configuration_takes_what_was_fitted_for_it():
    fits = InDecode.from_table("s.toml", FITS)
    assert fits.settings("exact", None, lookahead=False, prerouter=False, o_direct=False) == [
        ("build_ms_per_layer", 0.4), ("compute_factor", 1.01),
        ("dispatch_cpu_ms_per_layer", 0.45), ("cold_overhead_ms", 0.05),
        ("cold_fill_compute_ms", 0.18)]
    assert fits.settings("staged", "layer", lookahead=True, prerouter=True, o_direct=True) == [
        ("build_ms_per_layer", 0.2), ("fill_ms_per_layer", 0.31), ("compute_factor", 1.01),
        ("dispatch_cpu_ms_per_layer", 0.45), ("head_build_ms", 0.002),
        ("cold_overhead_ms", 0.03), ("cold_fill_compute_ms", 0.04)]
    # the token lead has no fill of its own: the staged path's; hot has no fits but these
    assert ("fill_ms_per_layer", 0.16) in fits.settings("staged", "token", True, True, False)
    assert fits.settings("hot", None, True, False, False) == [
        ("compute_factor", 1.01), ("dispatch_cpu_ms_per_layer", 0.45),
        ("cold_overhead_ms", 0.05), ("cold_fill_compute_ms", 0.04)]
    assert fits.budget_evict_ms == 0.03
    assert InDecode.from_table("s.toml", {}).settings("exact", None, False, False, False) == []


def test_a_fit_that_is_not_a_number_or_not_a_fit_is_one_line():
    with pytest.raises(BadInput, match=r"s\.toml: in_decode compute_factor: 'fast' is not a "
                                       "number"):
        InDecode.from_table("s.toml", {**FITS, "compute_factor": "fast"})
    with pytest.raises(BadInput, match=r"s\.toml: in_decode compute_factr: not a figure"):
        InDecode.from_table("s.toml", {**FITS, "compute_factr": 1.0})


def test_a_fit_left_in_the_notes_is_refused_with_where_it_belongs(tmp_path, ssdmoe):
    """A fitted figure in [notes] (text, which the replay does not read) is one line: a
    scenario written before the [in_decode] table is not silently replayed without its fits."""
    sc = tmp_path / "old.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n\n[notes]\n'
                  '"build_ms_per_layer.pure" = "0.14"\n"compute_factor" = "1.01"\n')
    out = ssdmoe("sim", "run", str(sc), "--set", "decode_steps=2")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    line = out.stderr.strip()
    assert "old.toml: notes compute_factor: a fitted figure, which belongs in the [in_decode] " \
        "table as a number" in line and "\n" not in line


def test_the_committed_scenario_replays_its_fits():
    """The committed scenario's fits are typed numbers and reach the replay's keys."""
    from sim.profiles import load_scenario

    sc = load_scenario("this-machine-tiny-trained")
    assert sc.in_decode and all(isinstance(v, float) for v in sc.in_decode.values())
    fits = InDecode.from_table(sc.source, sc.in_decode)
    assert dict(fits.settings("exact", None, False, False, False))["build_ms_per_layer"] \
        == sc.in_decode["build_ms_per_layer.exact"]


def test_validate_writes_only_what_the_replay_reads(tmp_path):
    from validation.decode_fits import write_fit

    assert is_fitted("fill_ms_per_layer.staged-layer") and is_fitted("compute_factor")
    assert not is_fitted("build_ms_per_layer.pure") and not is_fitted("fill_ms_per_layer.exact")
    sc = tmp_path / "s.toml"
    sc.write_text('[in_decode]\n"compute_factor" = 1.0  # old\n\n[notes]\n"x" = "y"\n')
    write_fit(sc, "handoff_ms.in_decode", 0.01, "fitted")
    write_fit(sc, "compute_factor", 1.25, "refitted")
    assert tomllib.loads(sc.read_text()) == {
        "in_decode": {"compute_factor": 1.25, "handoff_ms.in_decode": 0.01}, "notes": {"x": "y"}}
    assert sc.read_text().count("compute_factor") == 1
    fresh = tmp_path / "fresh.toml"
    fresh.write_text('hardware = "this-machine"\n')
    write_fit(fresh, "compute_factor", 1.5, "first fit")
    assert tomllib.loads(fresh.read_text())["in_decode"] == {"compute_factor": 1.5}
    with pytest.raises(ValueError, match="handof_ms.in_decode: not a figure"):
        write_fit(sc, "handof_ms.in_decode", 0.01, "a misspelt fit")
