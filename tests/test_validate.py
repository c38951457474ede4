"""`ssdmoe validate` (validation/): the matrix (axes swept from the defaults, corners,
calibration kept apart, bad matrix files), the error summary against hand-computed medians
and p90s, and an end-to-end run on tiny-random that captures, simulates, reports, resumes
and says what is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from contract.errors import BadInput
from validation.matrix import Config, default_matrix, load_matrix
from validation.report import error_summary, responsible
from validation.run import ape, median_figures, median_round


@pytest.fixture(scope="module")
def validate_model(tiny_random_converted, tmp_path_factory):
    """This module's own copy of the converted fixture: validate trains prerouter heads into the
    model it measures, and the session-wide one must stay as built for other modules' tests."""
    return shutil.copytree(tiny_random_converted, tmp_path_factory.mktemp("validate") / "model")


def test_default_matrix_sweeps_every_axis_from_the_defaults():
    from validation.calibration import FILL_PATHS, fill_path

    m = default_matrix(quick=True)
    configs = m.configs()
    names = [c.name for c in configs]
    assert len(names) == len(set(names))
    cal = [c for c in configs if c.role == "calibration"]
    paths = {"on-demand", "hot", "staged", "staged-token", "staged-layer"}
    assert configs[:len(cal)] == cal and {c.path for c in cal} == paths
    # one per path (and the staged path's two leads): its costs inside decode; every
    # lookahead path whose hand-over is fitted has one
    warm = [c for c in cal if c.page_cache == "all"]
    assert {c.path for c in warm} == paths and len(warm) == 5
    assert {fill_path(c.to_dict()) for c in warm} >= set(FILL_PATHS)
    # one reading cold on the main thread, one reading cold through reader threads
    cold = [c for c in cal if c.page_cache != "all"]
    assert [(c.path, c.storage) for c in cold] == [("on-demand", "unthrottled"),
                                                  ("hot", "unthrottled")]
    held = [c for c in configs if c.role == "held-out"]
    d = m.defaults
    for axis, values in m.axes.items():
        for v in values:
            # every sweep point is measured: held out, or (once) as a calibration configuration
            assert any(getattr(c, axis) == v and all(
                getattr(c, a) == getattr(d, a) for a in m.axes if a != axis)
                for c in held + cal), (axis, v)
    assert not {c.name for c in held} & {c.name for c in cal}
    # the axes: 3 budgets, 5 paths, unthrottled + 2 throttles, native + another K
    assert set(m.axes["path"]) == {"on-demand", "hot", "staged", "staged-token", "staged-layer"}
    assert len(m.axes["storage"]) >= 3 and len(m.axes["k"]) >= 2
    assert any(c.path == "staged-token" and c.read_mbps for c in held)


def test_capture_args():
    c = Config(path="staged-layer", page_cache="1/2", storage="15mbps", k="2")
    assert c.capture_args(None) == ["--preset", "staged", "--lead", "layer",
                                    "--page-cache-fraction", "0.5", "--read-mbps", "15",
                                    "--top-k", "2"]
    with pytest.raises(BadInput, match="needs prerouter heads"):
        Config(path="staged-token").capture_args(None)


@pytest.mark.parametrize("text,msg", [
    ('[axes]\nspeed = ["fast"]\n', "unknown axis 'speed'"),
    ('[defaults]\ncolour = "red"\n', "unknown axis 'colour'"),
    ('[axes]\nstorage = [0]\n', "must be > 0"),
    ('[axes]\nk = [0]\n', "integer >= 1"),
    ('[axes]\npath = ["warp"]\n', "path 'warp'"),
    ('[weird]\n', "unknown section"),
    ('[defaults]\npage_cache = "all"\npath = "staged"\n', "are a calibration configuration"),
    ('[axes\n', "not valid TOML"),
])
def test_bad_matrix_files(tmp_path, text, msg):
    f = tmp_path / "m.toml"
    f.write_text(text)
    with pytest.raises(BadInput, match=msg):
        load_matrix(f).configs()


def test_bad_matrix_via_cli_is_one_line(tmp_path, ssdmoe, validate_model):
    f = tmp_path / "m.toml"
    f.write_text('[axes]\nspeed = ["fast"]\n')
    r = ssdmoe("validate", str(validate_model), "--matrix", str(f), "--out",
               str(tmp_path / "v"))
    assert r.returncode == 2 and "unknown axis 'speed'" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _r(name, role, **ape_pct):
    return {"config": {"name": name, "role": role}, "ape_pct": ape_pct,
            "measured": {}, "simulated": {}}


def test_error_summary_by_hand():
    rs = [_r("a", "held-out", decode_tok_s=2.0), _r("b", "held-out", decode_tok_s=10.0),
          _r("c", "held-out", decode_tok_s=4.0), _r("d", "held-out", decode_tok_s=None),
          _r("cal", "calibration", decode_tok_s=99.0)]
    s = error_summary(rs)["decode_tok_s"]
    assert s["n"] == 3  # the calibration configuration and the undefined one are left out
    assert s["median_ape_pct"] == 4.0
    # numpy's linear p90 of [2, 4, 10]: 4 + 0.8 * (10 - 4)
    assert s["p90_ape_pct"] == pytest.approx(8.8)
    assert ape(50.0, 55.0) == pytest.approx(10.0) and ape(50.0, 45.0) == pytest.approx(10.0)
    assert ape(0.0, 1.0) is None


def test_round_spread_by_hand():
    """A configuration's noise is its farthest round from the rounds' median decode tok/s:
    rounds 10, 12, 8, 11 have median 10.5 and the farthest, 8, lies 2.5 off (23.8%)."""
    from validation.report import _noise_markdown, round_spread_pct, spread_summary

    def rounds(name, role, speeds):
        r = _r(name, role, decode_tok_s=1.0)
        r["rounds_decode_tok_s"] = speeds
        return r

    a = rounds("a", "held-out", [10.0, 12.0, 8.0, 11.0])
    assert round_spread_pct(a) == pytest.approx(250 / 10.5)
    assert round_spread_pct(rounds("one", "held-out", [10.0])) is None
    rs = [a, rounds("b", "held-out", [20.0, 21.0, 19.0]),  # 5% off
          rounds("c", "held-out", [30.0, 30.0, 33.0]),  # 10% off
          rounds("cal", "calibration", [1.0, 9.0])]  # left out: calibration
    s = spread_summary(rs)
    assert s["n"] == 3 and s["median_pct"] == pytest.approx(10.0)
    assert s["p90_pct"] == pytest.approx(10 + 0.8 * (250 / 10.5 - 10))
    text = " ".join(_noise_markdown(s, {"decode_tok_s": {"median_ape_pct": 7.0}}))
    assert "a median 10.0% (p90 21.0%, 3 configurations)" in text
    assert "(7.0%) is inside that noise" in text and "neither met nor missed" in text
    quiet = " ".join(_noise_markdown({"median_pct": 2.0, "p90_pct": 3.0, "n": 3},
                                     {"decode_tok_s": {"median_ape_pct": 7.0}}))
    assert "inside that noise" not in quiet and "neither met" not in quiet
    assert _noise_markdown({"median_pct": None}, {}) == []


def test_responsible_component_is_the_largest_miss():
    r = {"measured": {"build_ms_per_step": 5.0, "eval_ms_per_step": 2.0,
                      "blocked_ms_per_step": 3.0},
         "simulated": {"build_ms_per_step": 4.5, "eval_ms_per_step": 4.0,
                       "blocked_ms_per_step": 1.0}}
    comp, diff = responsible(r)
    assert comp in ("eval_ms_per_step", "blocked_ms_per_step") and abs(diff) == 2.0


MATRIX = """
[axes]
page_cache = ["1/4"]
path = ["on-demand", "staged-layer"]
storage = ["unthrottled"]
k = ["native", "2"]
"""


@pytest.mark.slow
def test_end_to_end_resume_and_missing(tmp_path, ssdmoe_subprocess, validate_model):
    f = tmp_path / "m.toml"
    f.write_text(MATRIX)
    out = tmp_path / "v"
    args = ("validate", str(validate_model), "--matrix", str(f), "--out", str(out),
            "--no-calibrate", "--prompts", "1", "--max-tokens", "6")
    r = ssdmoe_subprocess(*args)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "validation.json").read_text())
    names = {x["config"]["name"] for x in doc["results"]}
    assert names == {"on-demand-pcall-unthrottled", "hot-pcall-unthrottled",
                     "staged-pcall-unthrottled", "staged-token-pcall-unthrottled",
                     "staged-layer-pcall-unthrottled", "on-demand-pc50-unthrottled",
                     "hot-pc50-unthrottled", "on-demand-pc25-unthrottled",
                     "staged-layer-pc25-unthrottled", "on-demand-pc25-unthrottled-k2"}
    assert doc["missing"] == []
    for x in doc["results"]:
        assert set(x["ape_pct"]) >= {"decode_tok_s", "build_ms_per_step", "blocked_ms_per_step"}
        assert x["measured"]["decode_tok_s"] > 0 and x["simulated"]["decode_tok_s"] > 0
        run = json.loads((out / "traces" / x["config"]["name"] / "run.json").read_text())
        assert run["complete"] and run["extra"]["capture"]["decode_routing"]["mode"] == "sampled"
    k2 = json.loads((out / "traces" / "on-demand-pc25-unthrottled-k2" / "run.json").read_text())
    assert k2["engine"]["k"] == 2
    for png in ("scatter.png", "errors.png", "worst-timeline.png"):
        assert (out / png).stat().st_size > 1000
    md = (out / "README.md").read_text()
    assert "held-out" in md and "The worst configuration" in md
    # interrupted: one configuration's result lost -> reported missing until re-run, others kept
    lost = "staged-layer-pc25-unthrottled"
    shutil.rmtree(out / "traces" / lost)
    (out / "results" / f"{lost}.json").unlink()
    kept = out / "traces" / "on-demand-pc25-unthrottled" / "run.json"
    before = kept.stat().st_mtime_ns
    r2 = ssdmoe_subprocess(*args)
    assert r2.returncode == 0, r2.stderr
    assert "kept (already measured)" in r2.stderr and f"{lost} (held-out): capturing" in r2.stderr
    assert kept.stat().st_mtime_ns == before  # not captured again (compared again on the fit)
    assert (out / "results" / f"{lost}.json").is_file()


def test_calibration_fit_by_hand(tmp_path):
    """Each warm calibration configuration fits its path's graph building; the eval of the
    synchronous loop's (on-demand: eval is the compute and its syncs) fits compute_factor,
    that of the lookahead loop's (staged) the main-thread dispatch per layer instead:
      compute_factor 1.0 x 4.5 / 3.0 = 1.5 (the staged result's 3.0 / 2.5 is not in it:
      with it the median would be 1.35)
      fill_ms_per_layer.staged = the model profile's isolated figure + (3.0 - 2.5) / 6 layers;
      the hot path's has no warm hot configuration here: not fitted."""
    from sim.profiles import load_hardware, load_model
    from validation.calibration import current_note, fit, fitted_build

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
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n\n[notes]\n'
                  '"build_ms_per_layer.staged" = "0.2000"  # old\n'
                  '"build_ms_per_layer.hot" = "0.1000"  # untouched\n')
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
    assert current_note(sc, "build_ms_per_layer.staged") == pytest.approx(1.2)
    assert current_note(sc, "build_ms_per_layer.hot") == pytest.approx(0.1)
    assert current_note(sc, "compute_factor") == pytest.approx(1.5)
    assert current_note(sc, "fill_ms_per_layer.staged") == pytest.approx(isolated + 0.5 / 6,
                                                                          abs=1e-4)
    assert current_note(sc, "fill_ms_per_layer.hot") is None
    import tomllib

    assert tomllib.loads(sc.read_text())["notes"]["build_ms_per_layer.staged"] == "1.2000"


def test_dispatch_fit_is_per_lookahead_path(tmp_path):
    """fill_ms_per_layer.<path> = the model profile's isolated figure + the median of
    (measured - simulated eval) / layers over that path's warm lookahead configurations:
      hot:    + (7.2 - 6.0) / 6 = 0.2 (hot-pcall alone)
      staged: + median((8.0 - 7.4) / 6, (8.0 - 7.7) / 6) = 0.075 (with and without heads)
    The synchronous on-demand configuration fits compute_factor only."""
    from sim.profiles import load_model
    from validation.calibration import current_note, fit_machine

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
    assert current_note(sc, "fill_ms_per_layer.hot") == pytest.approx(isolated + 0.2, abs=1e-4)


def test_the_layer_lead_fits_its_own_hand_over_and_nothing_machine_wide(tmp_path):
    """The staged path with the layer lead, every expert cached, fits
    fill_ms_per_layer.staged-layer alone: isolated + (9.0 - 7.8) / 6 = + 0.2; the staged
    path's stays + (8.0 - 7.4) / 6 = + 0.1 (with the layer lead in its median: + 0.15), and
    its blocked time and readers' start (far off here) move neither the warm load's cost
    (+ (1.0 - 0.4) / 6 = + 0.1 from the staged one alone; with it the median: + 0.3) nor the
    readers' wake-up (+ 0.05 alone; with it + 0.25)."""
    from sim.profiles import load_hardware, load_model
    from validation.calibration import fit_machine

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
    from validation.calibration import current_note

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n\n[notes]\n'
                  '"build_ms_per_layer.staged" = "0.2519"  # fitted\n'
                  '"handoff_ms.in_decode" = "0.8207"  # fitted\n'
                  '"build_ms_per_layer.pure" = "0.1090"  # measured, never fitted\n')
    fit_file = tmp_path / "calibration-fit.json"
    _refit_from_isolated(sc, fit_file)  # no fit file yet (a fresh run): unchanged
    assert current_note(sc, "handoff_ms.in_decode") == pytest.approx(0.8207)
    fit_file.write_text(json.dumps({
        "build_ms_per_layer.staged": {"before": 0.1995, "after": 0.2519},
        "handoff_ms.in_decode": {"before": 0.0869, "after": 0.8207}}))
    _refit_from_isolated(sc, fit_file)
    assert current_note(sc, "build_ms_per_layer.staged") == pytest.approx(0.1995)
    assert current_note(sc, "handoff_ms.in_decode") == pytest.approx(0.0869)
    assert current_note(sc, "build_ms_per_layer.pure") == pytest.approx(0.1090)


def test_reader_handoff_fit_by_hand(tmp_path):
    """handoff_ms.in_decode = isolated + (measured - simulated) blocked time per fill past its
    loads' span (0.06 - 0.26: -0.2 ms), from the calibration configuration whose readers read
    cold; not from the whole blocked time (2 ms long here: it holds the reads); held-out ones
    and main-thread-only ones change nothing."""
    from validation.calibration import current_note, fit_handoff

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
    assert current_note(sc, "handoff_ms.in_decode") == pytest.approx(isolated - 0.2, abs=1e-4)
    assert fit_handoff([held, main_only], sc, isolated) == {}


def test_reader_wake_fit_by_hand(tmp_path):
    """reader_wake_ms.in_decode = isolated + median(measured - simulated delay of an idle
    reader's start) over the calibration configurations that have such loads (0.2 and 0.1 ->
    +0.15); held-out ones and ones without reader loads change nothing."""
    from validation.calibration import current_note, fit_reader_wake

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
    assert current_note(sc, "reader_wake_ms.in_decode") == pytest.approx(isolated + 0.15,
                                                                         abs=1e-4)
    assert fit_reader_wake([held, main_only], sc, isolated) == {}


def test_reader_start_delay_counts_only_loads_handed_to_an_idle_reader():
    """sim.compare.reader_start_ms by hand: a reader's load issued while its previous one was
    still reading waited in the queue, not for a wake-up; the main thread's loads are not
    readers' and prefill's are not decode's."""
    from types import SimpleNamespace

    import polars as pl

    from sim.compare import reader_start_ms

    steps = pl.DataFrame({"step": [0, 1], "phase": ["prefill", "decode"]})
    rows = [  # (step, thread, issued, started, finished) in ns
        (1, "reader-0", 1_000, 1_300, 2_000),  # idle: 300
        (1, "reader-0", 1_500, 2_050, 3_000),  # queued behind the one before: not a wake
        (1, "reader-0", 4_000, 4_100, 5_000),  # idle: 100
        (1, "reader-1", 1_000, 1_600, 1_900),  # idle: 600
        (1, "main", 1_000, 9_000, 9_500),
        (0, "reader-1", 0, 50_000, 60_000),  # prefill
    ]
    loads = pl.DataFrame(rows, schema=["step", "thread", "issued_ns", "started_ns",
                                       "finished_ns"], orient="row")
    trace = SimpleNamespace(steps=steps, loads=loads)
    assert reader_start_ms(trace) == pytest.approx(300 / 1e6)  # median of 300, 100, 600
    assert reader_start_ms(SimpleNamespace(steps=steps, loads=loads.filter(
        pl.col("thread") == "main"))) is None


def test_blocked_past_loads_and_cold_read_by_hand():
    """sim.compare.blocked_past_loads_ms by hand: per fill (a decode step's layer with expert
    loads), the main thread's blocked time beyond its loads' span, first issue to last
    finish. Step 1 blocked 3000 ns over fills of span 1400 (two loads, 100 -> 1500) and 500;
    step 2 blocked 1000 over one of 800: (4000 - 2700) / 3 fills = 433.3 ns. Prefill's loads
    and a whole-layer load (expert -1) are not a fill's. cold_read_ms: the mean start to
    finish of the decode steps' cold expert loads on any thread, (800 + 500) / 2 ns."""
    from types import SimpleNamespace

    import polars as pl

    from sim.compare import blocked_past_loads_ms, cold_read_ms

    steps = pl.DataFrame({"step": [0, 1, 2], "phase": ["prefill", "decode", "decode"],
                          "blocked_ns": [90_000, 3_000, 1_000]})
    rows = [  # (step, layer, expert, thread, cold, issued, started, finished) in ns
        (1, 0, 3, "main", False, 100, 100, 1_100),
        (1, 0, 5, "reader-0", True, 200, 700, 1_500),
        (1, 1, 2, "main", True, 2_000, 2_000, 2_500),
        (2, 0, 1, "reader-1", False, 0, 100, 800),
        (0, 0, 1, "main", True, 0, 0, 50_000),  # prefill
        (1, 2, -1, "main", True, 0, 0, 70_000),  # a whole layer
    ]
    loads = pl.DataFrame(rows, schema=["step", "layer", "expert", "thread", "cold",
                                       "issued_ns", "started_ns", "finished_ns"], orient="row")
    trace = SimpleNamespace(steps=steps, loads=loads)
    assert blocked_past_loads_ms(trace) == pytest.approx(1300 / 3 / 1e6)
    assert cold_read_ms(trace) == pytest.approx(650 / 1e6)
    warm = SimpleNamespace(steps=steps, loads=loads.filter(~pl.col("cold")))
    assert cold_read_ms(warm) is None
    none = SimpleNamespace(steps=steps, loads=loads.filter(pl.col("step") == 0))
    assert blocked_past_loads_ms(none) is None


def test_build_per_cold_read_is_the_slope_over_the_decode_steps_by_hand():
    """sim.compare.build_per_cold_read_ms by hand: the least-squares slope of build time over
    cold loads per decode step. Steps (cold, build ms): (0, 2.0), (2, 2.1), (4, 2.3), (6, 2.6)
    -> slope = sum((x - 3)(y - 2.25)) / sum((x - 3)^2) = 2.0 / 20 = 0.1 ms per cold read (the
    intercept, 1.95 ms in this capture, is not in it); prefill's steps are not decode's."""
    from types import SimpleNamespace

    import polars as pl

    from sim.compare import build_per_cold_read_ms

    steps = pl.DataFrame({"phase": ["prefill", "decode", "decode", "decode", "decode"],
                          "cold_loads": [40, 0, 2, 4, 6],
                          "build_ns": [90_000_000, 2_000_000, 2_100_000, 2_300_000, 2_600_000]})
    assert build_per_cold_read_ms(SimpleNamespace(steps=steps)) == pytest.approx(0.1)
    # another capture, 1 ms slower on every step: the same slope
    slower = steps.with_columns(pl.col("build_ns") + 1_000_000)
    assert build_per_cold_read_ms(SimpleNamespace(steps=slower)) == pytest.approx(0.1)
    # every step as cold as the others: no slope to read
    flat = steps.with_columns(pl.lit(3).alias("cold_loads"))
    assert build_per_cold_read_ms(SimpleNamespace(steps=flat)) is None


def test_cold_fit_by_hand(tmp_path):
    """From the configuration that reads cold on the main thread only (on-demand under a
    page-cache budget, unthrottled): the budget's main-thread work per cold read = old +
    measured - simulated slope of build over cold loads = 0.3 + 0.1 - 0.35 = 0.05 (not from the
    build time per step, which a slow spell moves: here it is 3 ms long and changes nothing).
    The cold overhead is not fitted from its blocked time (2 ms a step long here): a cold
    read's gap is the latency fit's alone. A throttled one and a reader path's are not in it."""
    from validation.calibration import current_note, fit_budget_evict

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
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n\n[notes]\n'
                  '"budget_evict_ms.in_decode" = "0.3000"  # old\n')
    got = fit_budget_evict([cold, throttled, hot], sc)
    assert got == {"budget_evict_ms.in_decode": {"before": 0.3, "after": pytest.approx(0.05)}}
    assert current_note(sc, "cold_overhead_ms.in_decode") is None
    assert current_note(sc, "budget_evict_ms.in_decode") == pytest.approx(0.05, abs=1e-4)
    # no slope measured (the cold loads did not vary): the drops are not fitted
    del cold["measured"]["build_per_cold_read_ms"]
    assert fit_budget_evict([cold], sc) == {}


def test_latency_fit_by_hand(tmp_path):
    """ssd_latency_ms.in_decode = old + (measured - simulated mean cold read) / preads per
    bundle, from the configuration that reads cold on the main thread: 0.088 + (0.74 - 0.93)
    / 9 = 0.0669 (a calibrate that met a slow device); a reader path's reads, which wait on
    cores and the GIL as well, are not in it. sim compare then sets it on every trace."""
    from validation.calibration import current_note, fit_latency

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
    assert current_note(sc, "ssd_latency_ms.in_decode") == pytest.approx(0.0669, abs=1e-4)
    assert fit_latency([readers], sc, 0.088, 9) == {}  # no main-thread cold reads: no fit


def test_head_build_fit_by_hand(tmp_path):
    """head_build_ms.in_decode = old + (measured - simulated build) / heads, from the warm
    configuration with heads only; sim compare then sets it on traces taken with heads."""
    from validation.calibration import current_note, fit_heads

    sc = tmp_path / "s.toml"
    sc.write_text('hardware = "this-machine"\nmodel = "tiny-trained"\n\n[notes]\n'
                  '"head_build_ms.in_decode" = "0.1000"  # old\n')
    token = {"config": {"name": "staged-token-pcall-unthrottled", "path": "staged-token",
                        "page_cache": "all", "role": "calibration"}, "heads": 5,
             "measured": {"build_ms_per_step": 9.0}, "simulated": {"build_ms_per_step": 7.0}}
    cold = {**token, "config": {**token["config"], "page_cache": "1/4"},
            "measured": {"build_ms_per_step": 30.0}}
    no_heads = {**token, "config": {**token["config"], "path": "staged"}, "heads": 0}
    got = fit_heads([token, cold, no_heads], sc)
    assert got == {"head_build_ms.in_decode": {"before": 0.1, "after": pytest.approx(0.5)}}
    assert current_note(sc, "head_build_ms.in_decode") == pytest.approx(0.5)
    assert fit_heads([cold, no_heads], sc) == {}


def test_rounds_give_each_figure_its_own_median_by_hand():
    # round 1 is the median by decode tok/s, but a slow spell stretched its build: the
    # measured build is the middle of 4, 9, 5 (5), not round 1's 9
    figures = {0: {"decode_tok_s": 50.0, "build_ms_per_step": 4.0, "blocked_ms_per_step": 2.0,
                   "reader_start_ms": None},
               1: {"decode_tok_s": 40.0, "build_ms_per_step": 9.0, "blocked_ms_per_step": 1.0,
                   "reader_start_ms": 0.2},
               2: {"decode_tok_s": 30.0, "build_ms_per_step": 5.0, "blocked_ms_per_step": 3.0,
                   "reader_start_ms": 0.4}}
    assert median_round(figures) == 1
    m = median_figures(figures)
    assert m == {"decode_tok_s": 40.0, "build_ms_per_step": 5.0, "blocked_ms_per_step": 2.0,
                 "reader_start_ms": pytest.approx(0.3)}  # the rounds that have it
    # an even count: the lower middle round is replayed, each figure the mean of the middle two
    del figures[2]
    assert median_round(figures) == 1
    assert median_figures(figures)["build_ms_per_step"] == pytest.approx(6.5)
    assert median_figures({0: {"reader_start_ms": None}}) == {"reader_start_ms": None}


def test_throttle_axis_values():
    m = default_matrix(quick=True, throttles=["30", "500iops"])
    assert m.axes["storage"] == ["unthrottled", "30mbps", "500iops"]
    slow = [c for c in m.corners if c.throttled]
    assert slow and all(c.storage == "500iops" for c in slow)
    c = Config(storage="500iops")
    assert c.read_iops == 500 and c.read_mbps is None
    assert c.capture_args(None)[-2:] == ["--read-iops", "500"]
    with pytest.raises(BadInput, match="expected"):
        default_matrix(throttles=["fast"])


@pytest.mark.slow
def test_interrupted_run_reports_what_it_measured(tmp_path, validate_model):
    """Ctrl-C (SIGINT to the process group) after the first configuration: exit 130, the report
    holds what was measured and names what is missing; no trace is lost."""
    import os
    import signal
    import subprocess
    import sys
    import time

    f = tmp_path / "m.toml"
    f.write_text(MATRIX)
    out = tmp_path / "v"
    cmd = [sys.executable, "-m", "ssdmoe_cli", "validate", str(validate_model),
           "--matrix", str(f), "--out", str(out), "--no-calibrate", "--prompts", "1",
           "--max-tokens", "6"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    deadline = time.monotonic() + 240
    for line in p.stderr:
        seen.append(line)
        if "done in" in line or time.monotonic() > deadline:
            break
    os.killpg(p.pid, signal.SIGINT)
    _, rest = p.communicate(timeout=120)
    err = "".join(seen) + rest
    assert p.returncode == 130, err
    doc = json.loads((out / "validation.json").read_text())
    assert len(doc["results"]) >= 1 and doc["missing"], err
    assert "Incomplete run" in (out / "README.md").read_text()
    for r in doc["results"]:
        assert (out / "traces" / r["config"]["name"] / "run.json").is_file()
    assert "Traceback" not in err


ROUNDS_MATRIX = """
[axes]
page_cache = ["1/4"]
path = ["on-demand"]
storage = ["unthrottled"]
k = ["native"]
[calibration]
path = "hot"
page_cache = "all"
"""


@pytest.mark.slow
def test_rounds_capture_each_configuration_again_and_compare_the_median(
        tmp_path, ssdmoe_subprocess, validate_model):
    f = tmp_path / "m.toml"
    f.write_text(ROUNDS_MATRIX)
    out = tmp_path / "v"
    r = ssdmoe_subprocess("validate", str(validate_model), "--matrix", str(f), "--out",
                          str(out), "--no-calibrate", "--prompts", "1", "--max-tokens", "6",
                          "--rounds", "3")
    assert r.returncode == 0, r.stderr
    assert "capturing round 3/3" in r.stderr
    doc = json.loads((out / "validation.json").read_text())
    assert {x["config"]["name"] for x in doc["results"]} == {"hot-pcall-unthrottled",
                                                             "on-demand-pc25-unthrottled"}
    for x in doc["results"]:
        name = x["config"]["name"]
        assert all((out / "traces" / d / "run.json").is_file()
                   for d in (name, f"{name}.r1", f"{name}.r2"))
        speeds = x["rounds_decode_tok_s"]
        assert len(speeds) == 3
        # the compared round is the median one, and its speed is what was compared
        assert speeds[x["compared_round"]] == sorted(speeds)[1]
        assert x["measured"]["decode_tok_s"] == pytest.approx(speeds[x["compared_round"]])
        # every other measured figure is its own median over the rounds
        for k, values in x["rounds_measured"].items():
            assert len(values) == 3
            if all(v is not None for v in values):
                assert x["measured"][k] == pytest.approx(sorted(values)[1]), k
    assert "captured 3 times" in (out / "README.md").read_text()
    # --recompare: the same traces predicted again, nothing captured
    before = {x["config"]["name"]: x["measured"]["decode_tok_s"] for x in doc["results"]}
    again = ssdmoe_subprocess("validate", str(validate_model), "--matrix", str(f), "--out",
                              str(out), "--no-calibrate", "--prompts", "1", "--max-tokens", "6",
                              "--rounds", "3", "--recompare")
    assert again.returncode == 0, again.stderr
    assert "capturing" not in again.stderr and "kept" not in again.stderr
    doc2 = json.loads((out / "validation.json").read_text())
    assert {x["config"]["name"]: x["measured"]["decode_tok_s"] for x in doc2["results"]} == before
    # the report keeps the run that captured the traces and says when they were re-simulated
    assert doc2["command"] == doc["command"] and "--recompare" not in doc2["command"]
    assert "--recompare" in doc2["resimulated"]["command"]
    assert "Re-simulated by `ssdmoe validate" in (out / "README.md").read_text()
    # a slow spell stretches the replayed round's graph building 100-fold: its decode tok/s,
    # from the steps' start and end, stays the median, but its build is now the largest, and
    # the measured build is the median of the rounds, not the replayed round's
    import polars as pl

    x = doc2["results"][0]
    replayed = out / "traces" / Path(x["trace"]).name
    for part in (replayed / "steps").glob("*.parquet"):
        pl.read_parquet(part).with_columns(pl.col("build_ns") * 100).write_parquet(part)
    slow = ssdmoe_subprocess("validate", str(validate_model), "--matrix", str(f), "--out",
                             str(out), "--no-calibrate", "--prompts", "1", "--max-tokens", "6",
                             "--rounds", "3", "--recompare")
    assert slow.returncode == 0, slow.stderr
    y = {r["config"]["name"]: r for r in json.loads((out / "validation.json").read_text())[
        "results"]}[x["config"]["name"]]
    builds = y["rounds_measured"]["build_ms_per_step"]
    assert y["compared_round"] == x["compared_round"]
    assert builds[y["compared_round"]] == max(builds)
    assert y["measured"]["build_ms_per_step"] == pytest.approx(sorted(builds)[1])
    assert y["measured"]["build_ms_per_step"] < builds[y["compared_round"]] / 10
    # traces captured on another conversion (its manifest hashes differently): said, kept
    stamp = out / "run-settings.json"
    settings = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**settings, "model_sha256": "ab" * 32}))
    moved = ssdmoe_subprocess("validate", str(validate_model), "--matrix", str(f), "--out",
                              str(out), "--no-calibrate", "--prompts", "1", "--max-tokens", "6",
                              "--rounds", "3", "--recompare")
    assert moved.returncode == 0, moved.stderr
    assert "captured on model manifest abababababab" in moved.stderr
    assert "starting over" not in moved.stderr and "capturing" not in moved.stderr
    doc3 = json.loads((out / "validation.json").read_text())
    assert {x["config"]["name"]: x["measured"]["decode_tok_s"] for x in doc3["results"]} == before
    assert doc3["model_sha256"] == "ab" * 32  # the report names the traces' model
    # other settings than those captured: one line, nothing deleted
    other = ssdmoe_subprocess("validate", str(validate_model), "--matrix", str(f), "--out",
                              str(out), "--no-calibrate", "--prompts", "1", "--max-tokens", "7",
                              "--rounds", "3", "--recompare")
    assert other.returncode != 0 and "captured with max_tokens=6" in other.stderr
    assert "Traceback" not in other.stderr
    assert all((out / "traces" / x["config"]["name"] / "run.json").is_file()
               for x in doc3["results"])
    bad = ssdmoe_subprocess("validate", str(validate_model), "--matrix", str(f), "--out",
                            str(out), "--no-calibrate", "--rounds", "0")
    assert bad.returncode != 0 and "--rounds: must be >= 1, got 0" in bad.stderr


def test_lead_probe_section_shows_each_arm_as_the_probe_wrote_it(tmp_path):
    """The report's lead probe table: one row per arm, measured / simulated per figure and the
    four fill-point phases, in the columns their headers name (values made distinct so a
    swapped column shows)."""
    from validation.report import _probes_markdown

    arm = {"arm": "layer @ 0.25",
           "measured": {"decode_tok_s": 44.7, "build_ms": 2.37, "eval_ms": 13.77,
                        "blocked_ms": 7.76},
           "simulated": {"decode_tok_s": 64.4, "build_ms": 1.64, "eval_ms": 7.99,
                         "blocked_ms": 5.92},
           "phases_ms": {"start_next": 0.195, "fill": 1.381, "gather": 0.431, "kick": 1.113}}
    (tmp_path / "lead_probe.json").write_text(json.dumps(
        {"command": "uv run python reports/validation/lead_probe.py", "date": "today",
         "arms": [arm]}))
    lines = _probes_markdown(tmp_path)
    header = next(i for i, line in enumerate(lines) if line.startswith("| arm | tok/s"))
    assert lines[header].split(" | ")[4:] == ["blocked", "start next", "fill", "gather",
                                              "kick |"]
    assert lines[header + 2] == ("| layer @ 0.25 | 44.7 / 64.4 | 2.37 / 1.64 | 13.77 / 7.99 | "
                                 "7.76 / 5.92 | 0.195 | 1.381 | 0.431 | 1.113 |")


def test_bootstrap_median_matches_its_closed_form():
    """The median of n (odd) rounds drawn with replacement is at most the k-th smallest round
    when at least (n + 1) / 2 of the n draws are among the k smallest: a binomial tail with
    p = k / n. Five distinct rounds, 40000 draws, each order statistic's frequency."""
    from math import comb

    import numpy as np

    from validation.noise import median_draws

    speeds, n = [50.0, 20.0, 40.0, 10.0, 30.0], 5

    def at_most(k: int) -> float:
        p = k / n
        return sum(comb(n, j) * p**j * (1 - p) ** (n - j) for j in range((n + 1) // 2, n + 1))

    drawn = median_draws(speeds, 40000, np.random.default_rng(1))
    for k, value in enumerate(sorted(speeds), start=1):
        exact = at_most(k) - at_most(k - 1)
        assert np.mean(drawn == value) == pytest.approx(exact, abs=0.01)
    # by hand, the middle round: P(Bin(5, 0.6) >= 3) - P(Bin(5, 0.4) >= 3)
    # = (0.3456 + 0.2592 + 0.07776) - (0.2304 + 0.0768 + 0.01024) = 0.36512
    assert at_most(3) - at_most(2) == pytest.approx(0.36512)


def test_noise_summary_by_hand():
    """Rounds that never move give a floor of 0 and a fixed error; calibration configurations
    and single rounds are left out; a run of one configuration has no summary."""
    from validation.noise import noise_summary
    from validation.report import _noise_markdown

    def rounds(name, role, speeds, simulated):
        r = _r(name, role, decode_tok_s=1.0)
        r["rounds_decode_tok_s"] = speeds
        r["simulated"]["decode_tok_s"] = simulated
        return r

    steady = [rounds("a", "held-out", [10.0, 10.0, 10.0], 11.0),  # 10% off in every draw
              rounds("b", "held-out", [20.0, 20.0], 19.0),  # 5% off
              rounds("c", "held-out", [30.0], 99.0),  # one round: left out
              rounds("cal", "calibration", [1.0, 9.0, 5.0], 50.0)]
    s = noise_summary(steady, draws=200)
    assert s["n"] == 2
    assert s["floor"]["p90_pct"] == 0.0 and s["floor"]["p90_range_pct"] == [0.0, 0.0]
    assert s["simulated"]["median_pct"] == pytest.approx(7.5)
    assert s["simulated"]["p90_pct"] == pytest.approx(5.0 + 0.9 * 5.0)
    assert noise_summary(steady[:1]) == {}
    # a noisy configuration: its redrawn medians move, and so does the floor
    noisy = [rounds("a", "held-out", [10.0, 20.0, 30.0], 20.0),
             rounds("b", "held-out", [10.0, 20.0, 30.0], 20.0)]
    s = noise_summary(noisy, draws=4000)
    # each draw's median is 10, 20 or 30 (7/27, 13/27, 7/27): |20 - m| / m is 100%, 0 or 33%
    assert s["floor"] == s["simulated"]  # the simulated figure is the observed median here
    # a draw's p90 over two is 0 when both medians are 20 (p = (13/27)^2 = 0.23 > 5%) and
    # 100 when both are 10 (p = (7/27)^2 = 0.067 > 5%): the 5-95% range spans both
    assert s["floor"]["p90_range_pct"] == [0.0, 100.0]
    text = " ".join(_noise_markdown({"median_pct": 2.0, "p90_pct": 3.0, "n": 2}, {}, s))
    assert "4000 bootstrap draws" in text and "lower bound" in text


def test_cold_fill_fit_by_hand(tmp_path):
    """cold_fill_compute_ms.in_decode = old + (measured - simulated eval per step) / measured
    fills per step that waited on a cold load (7.0 - 6.0 over 2.5: +0.4 ms), from the lookahead
    loop's cold calibration configuration; a second pass adds to the first; warm, throttled,
    synchronous-loop and held-out configurations change nothing; the synchronous loop's note
    (.sync) comes from its own configuration alone."""
    from validation.calibration import current_note, fit_cold_fill

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
    assert current_note(sc, "cold_fill_compute_ms.in_decode") == pytest.approx(0.4, abs=1e-4)
    closer = {**hot, "simulated": {"eval_ms_per_step": 6.75}}  # 0.25 / 2.5 more
    fit_cold_fill([closer], sc)
    assert current_note(sc, "cold_fill_compute_ms.in_decode") == pytest.approx(0.5, abs=1e-4)
    assert fit_cold_fill([warm, held, throttled], sc) == {}
    # the synchronous loop's own note, from its own configuration only
    got = fit_cold_fill([hot, *others], sc, lookahead=False)
    assert got == {"cold_fill_compute_ms.sync": {"before": 0.0, "after": pytest.approx(0.4)}}
    assert current_note(sc, "cold_fill_compute_ms.in_decode") == pytest.approx(0.5, abs=1e-4)
