"""`sim sweep`: a grid's points are its cartesian product x seeds, run in worker processes; a
failing point is reported with its reason while the others run; outputs are written."""

from __future__ import annotations

import polars as pl
import pytest

from contract.errors import BadInput
from sim.profiles import load_scenario
from sim.replay import run_scenario
from sim.sweep import EXTRA_KEYS, load_grid, results_frame, run_grid
from sim.sweep_outputs import write_outputs
from traces.schema import SUMMARY_KEYS

HW = """
ram_gib = 8.0
os_reserve_gib = 0.0
ssd_bandwidth_gbps = 1.0
ssd_latency_ms = 0.1
queue_depth = 1
load_overhead_ms = 0.01
cold_overhead_ms = 0.0
memcpy_gbps = 0.0
readahead = true
cpu_factor = 1.0
mem_bandwidth_gbps = 100.0
compute_tflops = 1.0
slot_update_ms = 0.0
"""
MODEL = """
layers = 2
experts = 16
k = 2
bundle_bytes = 1048576
resident_bytes = 0
active_params = 1e6
kv_bytes_per_token = 0
consumer_first = -1
consumer_last = -1
heads = 0
head_bytes = 0
build_ms_per_layer = 1.0
head_build_ms = 0.0
"""


@pytest.fixture
def base(tmp_path):
    (tmp_path / "hw.toml").write_text(HW)
    (tmp_path / "m.toml").write_text(MODEL)
    path = tmp_path / "base.toml"
    path.write_text(f'hardware = "{tmp_path / "hw.toml"}"\nmodel = "{tmp_path / "m.toml"}"\n'
                    'path = "staged"\ndecode_steps = 30\nlru_bytes = 4194304\n')
    return path


def grid_file(tmp_path, base, body: str):
    path = tmp_path / "g.toml"
    path.write_text(f'name = "tiny"\nscenario = "{base}"\n' + body)
    return path


def test_points_are_the_product_times_seeds(tmp_path, base):
    g = load_grid(grid_file(tmp_path, base, 'seeds = [0, 1, 2]\n[axes]\nk = [1, 2]\n'
                            'path = ["exact", "hot", "staged"]\n'))
    points = g.points()
    assert len(points) == 2 * 3 * 3
    assert points[0] == {"k": 1, "path": "exact", "seed": 0}
    assert points[-1] == {"k": 2, "path": "staged", "seed": 2}
    assert len({tuple(sorted(p.items())) for p in points}) == len(points)


def test_failing_point_is_reported_and_the_others_run(tmp_path, base):
    g = load_grid(grid_file(tmp_path, base, 'set = ["decode_steps=20"]\n[axes]\n'
                            'ssd_bandwidth_gbps = [-1.0, 0.5, 2.0]\n'
                            'path = ["staged", "hot"]\n'))
    seen = []
    rows = run_grid(g, workers=2, progress=lambda done, total: seen.append((done, total)))
    assert len(rows) == 6 and seen[-1] == (6, 6)
    frame = results_frame(g, rows)
    failed = frame.filter(pl.col("status") == "failed")
    assert failed["ssd_bandwidth_gbps"].to_list() == [-1.0, -1.0]
    for err in failed["error"].to_list():
        assert "ssd_bandwidth_gbps" in err and "must be > 0" in err and "\n" not in err
    ok = frame.filter(pl.col("status") == "ok")
    assert ok.height == 4 and ok["error"].null_count() == 4
    # each worker's figures are what an in-process run of the same point gives
    for r in ok.iter_rows(named=True):
        sets = ["decode_steps=20", f"ssd_bandwidth_gbps={r['ssd_bandwidth_gbps']}",
                f"path={r['path']}"]
        sc = load_scenario(str(base), sets)
        direct = run_scenario(sc).metrics
        for key in SUMMARY_KEYS:
            if direct[key] is None:
                assert r[key] is None, key
            else:
                assert r[key] == pytest.approx(direct[key]), key
    # slower storage never decodes faster, on each path
    for path in ("staged", "hot"):
        part = ok.filter(pl.col("path") == path).sort("ssd_bandwidth_gbps")
        assert part["decode_tok_s"][0] < part["decode_tok_s"][1]


def test_outputs_parquet_pngs_readme(tmp_path, base):
    g = load_grid(grid_file(tmp_path, base, 'seeds = [0, 1]\n[axes]\n'
                            'lru_bytes = ["0", "2MiB", "8MiB"]\npath = ["staged", "hot"]\n'))
    rows = run_grid(g, workers=1)
    frame = results_frame(g, rows)
    out = tmp_path / "out"
    written = write_outputs(g, frame, out, "ssdmoe sim sweep g.toml")
    names = {p.name for p in written}
    assert names == {"results.parquet", "lru_bytes.png", "path.png", "README.md"}
    back = pl.read_parquet(out / "results.parquet")
    assert back.height == 3 * 2 * 2
    for col in ("point", "lru_bytes", "path", "seed", "status", "error", *SUMMARY_KEYS,
                *EXTRA_KEYS):
        assert col in back.columns, col
    assert back["lru_bytes"].to_list()[::4] == [0, 2 << 20, 8 << 20]  # sizes resolved to bytes
    # hot needs an LRU: the lru_bytes=0 hot points fail, everything else runs
    failed = back.filter(pl.col("status") == "failed")
    assert set(zip(failed["lru_bytes"], failed["path"], strict=True)) == {(0, "hot")}
    assert "at least one bundle" in failed["error"][0]
    for png in ("lru_bytes.png", "path.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (out / "README.md").read_text()
    assert "ssdmoe sim sweep g.toml" in readme and "failed: " in readme


def test_bad_grids_are_one_line_errors(tmp_path, base):
    with pytest.raises(BadInput, match=r"g.toml: axes.nope: unknown key"):
        load_grid(grid_file(tmp_path, base, "[axes]\nnope = [1, 2]\n"))
    with pytest.raises(BadInput, match=r"g.toml: axes: missing"):
        load_grid(grid_file(tmp_path, base, ""))
    with pytest.raises(BadInput, match=r"g.toml: axes.k: expected a non-empty list"):
        load_grid(grid_file(tmp_path, base, "[axes]\nk = 2\n"))
    with pytest.raises(BadInput, match=r"g.toml: metric: 'speed'"):
        load_grid(grid_file(tmp_path, base, 'metric = "speed"\n[axes]\nk = [1]\n'))


def test_cli_sweep(tmp_path, base, ssdmoe):
    grid = grid_file(tmp_path, base, '[axes]\nssd_bandwidth_gbps = [-2, 1]\n')
    r = ssdmoe("sim", "sweep", str(grid), "--workers", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert "2 points, 1 ok, 1 failed" in r.stdout
    assert "ssd_bandwidth_gbps: -2.0 must be > 0" in r.stdout
    assert (tmp_path / "o" / "ssd_bandwidth_gbps.png").is_file()
    bad = ssdmoe("sim", "sweep", str(tmp_path / "missing.toml"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no such grid file" in bad.stderr
