"""`sim compare` on a model that shares another model's decoder graph (graph_of) and has no
scenario of its own on this machine: it takes the in-decode figures validate fitted for the
graph's model here (the same engine, graph and machine; only the experts are wider), and a
named hardware profile, another machine's, takes none."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.compare import scenario_for
from sim.in_decode import InDecode
from sim.profiles import load_hardware, load_scenario
from traces.reader import read_trace

ROOT = Path(__file__).resolve().parents[1]
WIDE = (ROOT / "reports" / "transfer" / "validate" / "traces" / "tiny-trained-wide-stream"
        / "base-quarter" / "on-demand.r0")
GRAPH = ROOT / "scenarios" / "this-machine-tiny-trained.toml"

pytestmark = pytest.mark.skipif(not (WIDE.exists() and GRAPH.exists()),
                                reason="no committed wide-model trace or tiny-trained scenario")


def _fits_for_the_exact_path(table: dict[str, float]) -> list[str]:
    """The fits a replay of the on-demand trace takes: the exact path, in the synchronous loop
    (its routers sync at build: engine.generate turns the lookahead off)."""
    fits = InDecode.from_table("test", table)
    return [f"{k}={v}" for k, v in fits.settings("exact", "none", False, False, False)]


def test_a_graph_of_model_takes_the_graphs_in_decode_figures():
    graph = load_scenario("this-machine-tiny-trained")
    assert graph.in_decode.get("compute_factor")  # else this checks nothing
    sc, derived, notes = scenario_for(read_trace(WIDE))
    assert sc.model.graph_of == "tiny-trained"
    assert sc.in_decode == graph.in_decode
    expected = _fits_for_the_exact_path(graph.in_decode)
    assert expected and all(item in derived for item in expected)
    assert sc.hardware.compute_factor == pytest.approx(graph.in_decode["compute_factor"])
    assert any("graph_of" in n for n in notes)


def test_another_machines_profile_takes_none():
    sc, derived, _ = scenario_for(read_trace(WIDE), hardware="this-machine")
    assert sc.in_decode == {}
    assert not any(item.startswith("compute_factor=") for item in derived)
    assert sc.hardware.compute_factor == load_hardware("this-machine").compute_factor
