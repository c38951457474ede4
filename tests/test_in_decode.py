"""sim.in_decode: the figures validate fits inside decode, read once from a scenario's notes
and handed to a replay by its engine configuration (hand-worked)."""

from __future__ import annotations

import pytest

from contract.errors import BadInput
from sim.in_decode import InDecode, is_fitted

NOTES = {"build_ms_per_layer.exact": "0.4", "build_ms_per_layer.staged": "0.2",
         "build_ms_per_layer.pure": "0.14",  # a record, not a fit: left alone
         "fill_ms_per_layer.staged": "0.16", "fill_ms_per_layer.staged-layer": "0.31",
         "compute_factor": "1.01", "cold_overhead_ms.in_decode": "0.05",
         "cold_overhead_ms.o_direct": "0.03", "head_build_ms.in_decode": "0.002",
         "cold_fill_compute_ms.in_decode": "0.04", "cold_fill_compute_ms.sync": "0.18",
         "budget_evict_ms.in_decode": "0.03"}


def test_each_configuration_takes_what_was_fitted_for_it():
    fits = InDecode.from_notes("s.toml", NOTES)
    assert fits.settings("exact", None, lookahead=False, prerouter=False, o_direct=False) == [
        ("build_ms_per_layer", 0.4), ("compute_factor", 1.01), ("cold_overhead_ms", 0.05),
        ("cold_fill_compute_ms", 0.18)]
    assert fits.settings("staged", "layer", lookahead=True, prerouter=True, o_direct=True) == [
        ("build_ms_per_layer", 0.2), ("fill_ms_per_layer", 0.31), ("compute_factor", 1.01),
        ("head_build_ms", 0.002), ("cold_overhead_ms", 0.03), ("cold_fill_compute_ms", 0.04)]
    # the token lead has no fill of its own: the staged path's; hot has no fits but these
    assert ("fill_ms_per_layer", 0.16) in fits.settings("staged", "token", True, True, False)
    assert fits.settings("hot", None, True, False, False) == [
        ("compute_factor", 1.01), ("cold_overhead_ms", 0.05), ("cold_fill_compute_ms", 0.04)]
    assert fits.budget_evict_ms == 0.03
    assert InDecode.from_notes("s.toml", {}).settings("exact", None, False, False, False) == []


def test_a_fit_that_is_not_a_number_is_one_line():
    with pytest.raises(BadInput, match=r"s\.toml: notes compute_factor: 'fast' is not a number"):
        InDecode.from_notes("s.toml", {**NOTES, "compute_factor": "fast"})


def test_validate_writes_only_what_the_replay_reads(tmp_path):
    from validation.decode_fits import write_note

    assert is_fitted("fill_ms_per_layer.staged-layer") and is_fitted("compute_factor")
    assert not is_fitted("build_ms_per_layer.pure") and not is_fitted("fill_ms_per_layer.exact")
    sc = tmp_path / "s.toml"
    sc.write_text("[notes]\n")
    write_note(sc, "handoff_ms.in_decode", 0.01, "fitted")
    with pytest.raises(ValueError, match="handof_ms.in_decode: not a figure"):
        write_note(sc, "handof_ms.in_decode", 0.01, "a misspelt fit")
