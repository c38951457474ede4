"""`ssdmoe validate` (validation/): the matrix (axes swept from the defaults, corners,
calibration kept apart, bad matrix files), the rounds' medians by hand, and end-to-end runs on
tiny-random that capture, simulate, report, resume and say what is missing. The fits inside
decode: test_decode_fits.py; the report's figures: test_validate_report.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from contract.errors import BadInput
from validation.matrix import Config, default_matrix, load_matrix
from validation.matrix_run import median_figures, median_round


@pytest.fixture(scope="module")
def validate_model(tiny_random_converted, tmp_path_factory):
    """This module's own copy of the converted fixture: validate trains prerouter heads into the
    model it measures, and the session-wide one must stay as built for other modules' tests."""
    return shutil.copytree(tiny_random_converted, tmp_path_factory.mktemp("validate") / "model")


def test_default_matrix_sweeps_every_axis_from_the_defaults():
    from validation.decode_fits import FILL_PATHS, fill_path

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
