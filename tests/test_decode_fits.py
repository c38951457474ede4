"""The fits inside decode (validation.decode_fits), each by hand: what the calibration
configurations set in the profile, from the isolated figures, never from the last fit."""

from __future__ import annotations

import json
import tomllib

import pytest


def test_calibration_fit_by_hand(tmp_path):
    """Each warm calibration configuration fits its path's graph building; the eval of the
    synchronous loop's (on-demand: eval is the compute and its syncs) fits compute_factor,
    that of the lookahead loop's (staged) the main-thread dispatch per layer instead:
      compute_factor 1.0 x 4.5 / 3.0 = 1.5 (the staged result's 3.0 / 2.5 is not in it:
      with it the median would be 1.35)
      fill_ms_per_layer.staged = the model profile's isolated figure + (3.0 - 2.5) / 6 layers;
      the hot path's has no warm hot configuration here: not fitted."""
    from sim.profiles import load_hardware, load_model
    from validation.decode_fits import current_fit, fit, fitted_build

    isolated = load_model("tiny-trained").fill_ms_per_layer

    r = {"config": {"name": "staged-pcall-unthrottled", "path": "staged", "page_cache": "all"},
         "measured": {"build_ms_per_step": 8.0, "eval_ms_per_step": 3.0,
                      "blocked_ms_per_step": 1.0, "loads_per_step": 6.0},
         "simulated": {"build_ms_per_step": 2.0, "eval_ms_per_step": 2.5,
                       "blocked_ms_per_step": 0.4},
         "layers": 6, "settings": ["path=staged", "lookahead=true"]}
    sync = {"config": {"name": "on-demand-pcall-unthrottled", "path": "on-demand",
                       "page_cache": "all"},
            "measured": {"build_ms_per_step": 3.0, "eval_ms_per_step": 4.5,
                         "blocked_ms_per_step": 1.0, "loads_per_step": 6.0},
            "simulated": {"build_ms_per_step": 3.0, "eval_ms_per_step": 3.0,
                          "blocked_ms_per_step": 0.4},
            "layers": 6, "settings": ["path=exact", "lookahead=false"]}
    assert fitted_build(r, 6, 0.2) == pytest.approx(0.2 + 6.0 / 6)
    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n\n[in_decode]\n'
                  '"build_ms_per_layer.staged" = 0.2000  # old\n'
                  '"build_ms_per_layer.hot" = 0.1000  # untouched\n')
    # the 1/4 page-cache result is not a calibration configuration: it changes nothing
    other = {**r, "config": {**r["config"], "page_cache": "1/4"},
             "measured": {**r["measured"], "eval_ms_per_step": 100.0}}
    got = fit([r, sync, other], sc)
    warm_load = load_hardware("this-machine").load_overhead_ms
    assert got == {"build_ms_per_layer.staged": {"before": 0.2, "after": pytest.approx(1.2),
                                                 "measured_build_ms_per_step": 8.0},
                   "compute_factor": {"before": 1.0, "after": pytest.approx(1.5)},
                   "fill_ms_per_layer.staged": {"before": isolated,
                                                "after": pytest.approx(isolated + 0.5 / 6)},
                   "load_overhead_ms.in_decode": {"before": warm_load,
                                                  "after": pytest.approx(warm_load + 0.1)}}
    assert current_fit(sc, "build_ms_per_layer.staged") == pytest.approx(1.2)
    assert current_fit(sc, "build_ms_per_layer.hot") == pytest.approx(0.1)
    assert current_fit(sc, "compute_factor") == pytest.approx(1.5)
    assert current_fit(sc, "fill_ms_per_layer.staged") == pytest.approx(isolated + 0.5 / 6,
                                                                          abs=1e-4)
    assert current_fit(sc, "fill_ms_per_layer.hot") is None
    assert tomllib.loads(sc.read_text())["in_decode"]["build_ms_per_layer.staged"] == 1.2


def test_dispatch_fit_is_per_lookahead_path(tmp_path):
    """fill_ms_per_layer.<path> = the model profile's isolated figure + the median of
    (measured - simulated eval) / layers over that path's warm lookahead configurations:
      hot:    + (7.2 - 6.0) / 6 = 0.2 (hot-pcall alone)
      staged: + median((8.0 - 7.4) / 6, (8.0 - 7.7) / 6) = 0.075 (with and without heads)
    The synchronous on-demand configuration fits compute_factor only."""
    from sim.profiles import load_model
    from validation.decode_fits import current_fit, fit_machine

    isolated = load_model("tiny-trained").fill_ms_per_layer

    def warm(name: str, path: str, lookahead: bool, measured: float, simulated: float) -> dict:
        return {"config": {"name": name, "path": path, "page_cache": "all"}, "layers": 6,
                "settings": [f"lookahead={'true' if lookahead else 'false'}"],
                "measured": {"eval_ms_per_step": measured}, "simulated": {
                    "eval_ms_per_step": simulated}}

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n')
    got = fit_machine([warm("hot-pcall", "hot", True, 7.2, 6.0),
                       warm("staged-pcall", "staged", True, 8.0, 7.4),
                       warm("staged-token-pcall", "staged-token", True, 8.0, 7.7),
                       warm("on-demand-pcall", "on-demand", False, 6.0, 5.0)], sc)
    assert got["fill_ms_per_layer.hot"] == {"before": isolated,
                                            "after": pytest.approx(isolated + 0.2)}
    assert got["fill_ms_per_layer.staged"] == {"before": isolated,
                                               "after": pytest.approx(isolated + 0.075)}
    assert got["compute_factor"] == {"before": 1.0, "after": pytest.approx(1.2)}
    assert current_fit(sc, "fill_ms_per_layer.hot") == pytest.approx(isolated + 0.2, abs=1e-4)


def test_the_layer_lead_fits_its_own_hand_over_and_nothing_machine_wide(tmp_path):
    """The staged path with the layer lead, every expert cached, fits
    fill_ms_per_layer.staged-layer alone: isolated + (9.0 - 7.8) / 6 = + 0.2; the staged
    path's stays + (8.0 - 7.4) / 6 = + 0.1 (with the layer lead in its median: + 0.15), and
    its blocked time and readers' start (far off here) move neither the warm load's cost
    (+ (1.0 - 0.4) / 6 = + 0.1 from the staged one alone; with it the median: + 0.3) nor the
    readers' wake-up (+ 0.05 alone; with it + 0.25)."""
    from sim.profiles import load_hardware, load_model
    from validation.decode_fits import fit_machine

    isolated = load_model("tiny-trained").fill_ms_per_layer
    hw = load_hardware("this-machine")

    def warm(name: str, path: str, measured_eval: float, simulated_eval: float,
             blocked: float, start: float) -> dict:
        return {"config": {"name": name, "path": path, "page_cache": "all",
                           "role": "calibration"}, "layers": 6,
                "settings": ["lookahead=true"],
                "measured": {"eval_ms_per_step": measured_eval, "blocked_ms_per_step": blocked,
                             "loads_per_step": 6.0, "reader_start_ms": start},
                "simulated": {"eval_ms_per_step": simulated_eval, "blocked_ms_per_step": 0.4,
                              "reader_start_ms": 0.1}}

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n')
    got = fit_machine([warm("staged-pcall", "staged", 8.0, 7.4, 1.0, 0.15),
                       warm("staged-layer-pcall", "staged-layer", 9.0, 7.8, 3.4, 0.55)], sc)
    assert got["fill_ms_per_layer.staged-layer"] == {"before": isolated,
                                                     "after": pytest.approx(isolated + 0.2)}
    assert got["fill_ms_per_layer.staged"]["after"] == pytest.approx(isolated + 0.1)
    assert got["load_overhead_ms.in_decode"]["after"] == pytest.approx(hw.load_overhead_ms
                                                                       + 0.1)
    assert got["reader_wake_ms.in_decode"]["after"] == pytest.approx(hw.reader_wake_ms + 0.05)


def test_a_refit_starts_from_the_isolated_figures_not_from_the_last_fit(tmp_path):
    """A resumed run or --recompare sets each fitted figure back to the `before` of the first
    fit before comparing anything, so the same traces give the same fit (the fit is a few
    correction rounds, not a fixed point: from its own result it walked on, 16.1% -> 10.8%
    p90 on one report); figures the fit never set are left alone; no fit file: nothing."""
    from ssdmoe_cli.validate_cmd import _refit_from_isolated
    from validation.decode_fits import current_fit

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n\n[notes]\n'
                  '"build_ms_per_layer.pure" = "0.1090"  # measured, never fitted\n\n'
                  '[in_decode]\n'
                  '"build_ms_per_layer.staged" = 0.2519  # fitted\n'
                  '"handoff_ms.in_decode" = 0.8207  # fitted\n')
    fit_file = tmp_path / "calibration-fit.json"
    _refit_from_isolated(sc, fit_file)  # no fit file yet (a fresh run): unchanged
    assert current_fit(sc, "handoff_ms.in_decode") == pytest.approx(0.8207)
    fit_file.write_text(json.dumps({
        "build_ms_per_layer.staged": {"before": 0.1995, "after": 0.2519},
        "handoff_ms.in_decode": {"before": 0.0869, "after": 0.8207}}))
    _refit_from_isolated(sc, fit_file)
    assert current_fit(sc, "build_ms_per_layer.staged") == pytest.approx(0.1995)
    assert current_fit(sc, "handoff_ms.in_decode") == pytest.approx(0.0869)
    assert tomllib.loads(sc.read_text())["notes"] == {"build_ms_per_layer.pure": "0.1090"}


def test_reader_handoff_fit_by_hand(tmp_path):
    """handoff_ms.in_decode = isolated + (measured - simulated) blocked time per fill past its
    loads' span (0.06 - 0.26: -0.2 ms), from the calibration configuration whose readers read
    cold; not from the whole blocked time (2 ms long here: it holds the reads); held-out ones
    and main-thread-only ones change nothing."""
    from validation.decode_fits import current_fit, fit_handoff

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n')
    isolated = 0.25
    hot = {"config": {"name": "hot-pc50-unthrottled", "path": "hot", "page_cache": "1/2",
                      "storage": "unthrottled", "role": "calibration"},
           "measured": {"blocked_ms_per_step": 5.0, "blocked_past_loads_ms": 0.06},
           "simulated": {"blocked_ms_per_step": 3.0, "blocked_past_loads_ms": 0.26}}
    held = {**hot, "config": {**hot["config"], "page_cache": "1/4", "role": "held-out"},
            "measured": {"blocked_ms_per_step": 50.0, "blocked_past_loads_ms": 9.0}}
    main_only = {**hot, "config": {**hot["config"], "path": "on-demand"},
                 "measured": {"blocked_ms_per_step": 5.0, "blocked_past_loads_ms": 4.0}}
    got = fit_handoff([hot, held, main_only], sc, isolated)
    assert got == {"handoff_ms.in_decode": {"before": isolated,
                                            "after": pytest.approx(isolated - 0.2)}}
    assert current_fit(sc, "handoff_ms.in_decode") == pytest.approx(isolated - 0.2, abs=1e-4)
    assert fit_handoff([held, main_only], sc, isolated) == {}


def test_reader_wake_fit_by_hand(tmp_path):
    """reader_wake_ms.in_decode = isolated + median(measured - simulated delay of an idle
    reader's start) over the calibration configurations that have such loads (0.2 and 0.1 ->
    +0.15); held-out ones and ones without reader loads change nothing."""
    from validation.decode_fits import current_fit, fit_reader_wake

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n')
    isolated = 0.03
    hot = {"config": {"name": "hot-pc50-unthrottled", "role": "calibration"},
           "measured": {"reader_start_ms": 0.25}, "simulated": {"reader_start_ms": 0.05}}
    token = {"config": {"name": "staged-token-pcall-unthrottled", "role": "calibration"},
             "measured": {"reader_start_ms": 0.10}, "simulated": {"reader_start_ms": 0.0}}
    held = {**hot, "config": {**hot["config"], "role": "held-out"},
            "measured": {"reader_start_ms": 5.0}}
    main_only = {"config": {"name": "on-demand-pc50-unthrottled", "role": "calibration"},
                 "measured": {"reader_start_ms": None}, "simulated": {"reader_start_ms": None}}
    got = fit_reader_wake([hot, token, held, main_only], sc, isolated)
    assert got == {"reader_wake_ms.in_decode": {"before": isolated,
                                                "after": pytest.approx(isolated + 0.15)}}
    assert current_fit(sc, "reader_wake_ms.in_decode") == pytest.approx(isolated + 0.15,
                                                                         abs=1e-4)
    assert fit_reader_wake([held, main_only], sc, isolated) == {}


def test_cold_fit_by_hand(tmp_path):
    """From the configuration that reads cold on the main thread only (on-demand under a
    page-cache budget, unthrottled): the budget's main-thread work per cold read = old +
    measured - simulated slope of build over cold loads = 0.3 + 0.1 - 0.35 = 0.05 (not from the
    build time per step, which a slow spell moves: here it is 3 ms long and changes nothing).
    The cold overhead is not fitted from its blocked time (2 ms a step long here): a cold
    read's gap is the latency fit's alone. A throttled one and a reader path's are not in it."""
    from validation.decode_fits import current_fit, fit_budget_evict

    cold = {"config": {"name": "on-demand-pc50-unthrottled", "path": "on-demand",
                       "page_cache": "1/2", "storage": "unthrottled"},
            "measured": {"blocked_ms_per_step": 9.0, "loads_per_step": 24.0,
                         "cold_fraction": 0.5, "build_ms_per_step": 8.0,
                         "build_per_cold_read_ms": 0.1},
            "simulated": {"blocked_ms_per_step": 7.0, "build_ms_per_step": 5.0,
                          "build_per_cold_read_ms": 0.35}}
    throttled = {**cold, "config": {**cold["config"], "storage": "15mbps"},
                 "measured": {**cold["measured"], "build_per_cold_read_ms": 9.0,
                              "blocked_ms_per_step": 90.0}}
    hot = {**throttled, "config": {**cold["config"], "path": "hot"}}
    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n\n[in_decode]\n'
                  '"budget_evict_ms.in_decode" = 0.3000  # old\n')
    got = fit_budget_evict([cold, throttled, hot], sc)
    assert got == {"budget_evict_ms.in_decode": {"before": 0.3, "after": pytest.approx(0.05)}}
    assert current_fit(sc, "cold_overhead_ms.in_decode") is None
    assert current_fit(sc, "budget_evict_ms.in_decode") == pytest.approx(0.05, abs=1e-4)
    # no slope measured (the cold loads did not vary): the drops are not fitted
    del cold["measured"]["build_per_cold_read_ms"]
    assert fit_budget_evict([cold], sc) == {}


def test_latency_fit_by_hand(tmp_path):
    """ssd_latency_ms.in_decode = old + (measured - simulated mean cold read) / preads per
    bundle, from the configuration that reads cold on the main thread: 0.088 + (0.74 - 0.93)
    / 9 = 0.0669 (a calibrate that met a slow device); a reader path's reads, which wait on
    cores and the GIL as well, are not in it. sim compare then sets it on every trace."""
    from validation.decode_fits import current_fit, fit_latency

    cold = {"config": {"name": "on-demand-pc50-unthrottled", "path": "on-demand",
                       "page_cache": "1/2", "storage": "unthrottled"},
            "measured": {"cold_read_ms": 0.74}, "simulated": {"cold_read_ms": 0.93}}
    readers = {"config": {**cold["config"], "path": "hot"},
               "measured": {"cold_read_ms": 1.0}, "simulated": {"cold_read_ms": 1.9}}
    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n')
    got = fit_latency([cold, readers], sc, 0.088, 9)
    assert got == {"ssd_latency_ms.in_decode": {"before": 0.088,
                                                "after": pytest.approx(0.088 - 0.19 / 9)}}
    assert current_fit(sc, "ssd_latency_ms.in_decode") == pytest.approx(0.0669, abs=1e-4)
    assert fit_latency([readers], sc, 0.088, 9) == {}  # no main-thread cold reads: no fit


def test_head_build_fit_by_hand(tmp_path):
    """head_build_ms.in_decode = old + (measured - simulated build) / heads, from the warm
    configuration with heads only; sim compare then sets it on traces taken with heads."""
    from validation.decode_fits import current_fit, fit_heads

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n\n[in_decode]\n'
                  '"head_build_ms.in_decode" = 0.1000  # old\n')
    token = {"config": {"name": "staged-token-pcall-unthrottled", "path": "staged-token",
                        "page_cache": "all", "role": "calibration"}, "heads": 5,
             "measured": {"build_ms_per_step": 9.0}, "simulated": {"build_ms_per_step": 7.0}}
    cold = {**token, "config": {**token["config"], "page_cache": "1/4"},
            "measured": {"build_ms_per_step": 30.0}}
    no_heads = {**token, "config": {**token["config"], "path": "staged"}, "heads": 0}
    got = fit_heads([token, cold, no_heads], sc)
    assert got == {"head_build_ms.in_decode": {"before": 0.1, "after": pytest.approx(0.5)}}
    assert current_fit(sc, "head_build_ms.in_decode") == pytest.approx(0.5)
    assert fit_heads([cold, no_heads], sc) == {}


def test_cold_fill_fit_by_hand(tmp_path):
    """cold_fill_compute_ms.in_decode = old + (measured - simulated eval per step) / measured
    fills per step that waited on a cold load (7.0 - 6.0 over 2.5: +0.4 ms), from the lookahead
    loop's cold calibration configuration; a second pass adds to the first; warm, throttled,
    synchronous-loop and held-out configurations change nothing; the synchronous loop's note
    (.sync) comes from its own configuration alone."""
    from validation.decode_fits import current_fit, fit_cold_fill

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n')
    hot = {"config": {"name": "hot-pc50-unthrottled", "path": "hot", "page_cache": "1/2",
                      "storage": "unthrottled", "role": "calibration"},
           "settings": ["path=hot", "lookahead=true"],
           "measured": {"eval_ms_per_step": 7.0, "cold_fills_per_step": 2.5},
           "simulated": {"eval_ms_per_step": 6.0, "cold_fills_per_step": 2.0}}
    warm = {**hot, "config": {**hot["config"], "page_cache": "all"},
            "measured": {"eval_ms_per_step": 9.0, "cold_fills_per_step": 0.0}}
    sync = {**hot, "config": {**hot["config"], "path": "on-demand"},
            "settings": ["path=exact", "lookahead=false"]}
    held = {**hot, "config": {**hot["config"], "page_cache": "1/4", "role": "held-out"},
            "measured": {"eval_ms_per_step": 20.0, "cold_fills_per_step": 2.0}}
    throttled = {**hot, "config": {**hot["config"], "storage": "15mbps"},
                 "measured": {"eval_ms_per_step": 20.0, "cold_fills_per_step": 2.0}}
    others = [warm, sync, held, throttled]
    got = fit_cold_fill([hot, *others], sc)
    assert got == {"cold_fill_compute_ms.in_decode": {"before": 0.0,
                                                      "after": pytest.approx(0.4)}}
    assert current_fit(sc, "cold_fill_compute_ms.in_decode") == pytest.approx(0.4, abs=1e-4)
    closer = {**hot, "simulated": {"eval_ms_per_step": 6.75}}  # 0.25 / 2.5 more
    fit_cold_fill([closer], sc)
    assert current_fit(sc, "cold_fill_compute_ms.in_decode") == pytest.approx(0.5, abs=1e-4)
    assert fit_cold_fill([warm, held, throttled], sc) == {}
    # the synchronous loop's own note, from its own configuration only
    got = fit_cold_fill([hot, *others], sc, lookahead=False)
    assert got == {"cold_fill_compute_ms.sync": {"before": 0.0, "after": pytest.approx(0.4)}}
    assert current_fit(sc, "cold_fill_compute_ms.in_decode") == pytest.approx(0.5, abs=1e-4)


def test_dispatch_cpu_fit_by_hand(tmp_path):
    """dispatch_cpu_ms_per_layer.in_decode = the model profile's figure + the median of
    (measured - simulated main-thread CPU) / layers over the warm lookahead configurations,
    the layer lead's left out:
      hot (5.4 - 4.8) / 6 = 0.1, staged (5.7 - 4.8) / 6 = 0.15, token lead (4.5 - 4.2) / 6 =
      0.05: median + 0.1 (with the layer lead's (6.0 - 4.2) / 6 = 0.3: + 0.125); the
    synchronous on-demand one (+ 1.0 a layer) is not in it, nor a configuration whose trace
    has no main-thread CPU."""
    from sim.profiles import load_model
    from validation.decode_fits import current_fit, fit_machine

    isolated = load_model("tiny-trained").dispatch_cpu_ms_per_layer

    def warm(name: str, path: str, lookahead: bool, main: float | None, sim: float) -> dict:
        return {"config": {"name": name, "path": path, "page_cache": "all"}, "layers": 6,
                "settings": [f"lookahead={'true' if lookahead else 'false'}"],
                "measured": {"main_cpu_ms_per_step": main},
                "simulated": {"main_cpu_ms_per_step": sim}}

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n')
    got = fit_machine([warm("hot-pcall", "hot", True, 5.4, 4.8),
                       warm("staged-pcall", "staged", True, 5.7, 4.8),
                       warm("staged-token-pcall", "staged-token", True, 4.5, 4.2),
                       warm("staged-layer-pcall", "staged-layer", True, 6.0, 4.2),
                       warm("old-trace", "staged", True, None, 1.0),
                       warm("on-demand-pcall", "on-demand", False, 12.0, 6.0)], sc)
    assert got["dispatch_cpu_ms_per_layer.in_decode"] == {
        "before": isolated, "after": pytest.approx(isolated + 0.1)}
    assert current_fit(sc, "dispatch_cpu_ms_per_layer.in_decode") == pytest.approx(
        isolated + 0.1, abs=1e-4)
