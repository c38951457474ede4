"""`sim sweep --backend ray` against the local backend: the same grid gives the same rows. The
test starts a local Ray instance (two CPUs) and shuts it down."""

from __future__ import annotations

import pytest
from test_sim_sweep import base, grid_file  # noqa: F401 - the fixture is used by name

from contract.errors import BadInput
from sim.sweep import load_grid, run_grid
from sim.sweep_ray import ray_module

TIMING = ("sim_wall_s", "sim_steps_per_s")  # wall-clock figures of the simulator itself


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.slow
def test_ray_backend_gives_the_local_rows(tmp_path, base):  # noqa: F811
    try:  # imported as the backend does it (its workers use this environment, not uv's)
        ray = ray_module()
    except BadInput:
        pytest.skip("the ray extra is not installed")
    g = load_grid(grid_file(tmp_path, base, 'set = ["decode_steps=20"]\nseeds = [0, 1]\n'
                            '[axes]\nssd_bandwidth_gbps = [-1.0, 0.5, 2.0]\n'
                            'path = ["staged", "hot"]\n'))
    local = run_grid(g, workers=1)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        seen = []
        remote = run_grid(g, backend="ray", progress=lambda d, t: seen.append((d, t)))
    finally:
        ray.shutdown()
    assert not ray.is_initialized()
    assert _strip(remote) == _strip(local)
    assert seen[-1] == (len(local), len(local))
    assert sum(r["status"] == "failed" for r in remote) == 4  # the bad bandwidth, as locally
    assert {r["status"] for r in remote} == {"ok", "failed"}


def test_unknown_backend_is_one_line(tmp_path, base):  # noqa: F811
    g = load_grid(grid_file(tmp_path, base, '[axes]\nk = [1, 2]\n'))
    with pytest.raises(BadInput, match=r"^--backend dask: unknown backend \(one of local, ray\)$"):
        run_grid(g, backend="dask")


def test_ray_not_installed_is_one_line(tmp_path, base, monkeypatch):  # noqa: F811
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # import ray -> ImportError
    g = load_grid(grid_file(tmp_path, base, '[axes]\nk = [1, 2]\n'))
    with pytest.raises(BadInput, match=r"^--backend ray: Ray is not installed \(install the "
                                       r"extra: uv sync --extra ray\)$"):
        run_grid(g, backend="ray")
