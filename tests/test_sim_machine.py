"""`sim compare` on a trace captured on an emulated machine (run.json extra.machine, written by
engine.machine_limits): the scenario gets the machine's cores, its CPU quota as a share of a
core, and the page cache its memory limit leaves; a trace without one is replayed as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sim.compare import scenario_for
from sim.memory_budget import budget
from traces.reader import read_trace

TRACE = (Path(__file__).resolve().parents[1] / "reports" / "validation" / "traces"
         / "on-demand-pc25-unthrottled")
MIB = 2**20


def _on_machine(tmp_path: Path, machine: dict | None, budget_bytes: int | None = None) -> Path:
    out = tmp_path / "trace"
    shutil.copytree(TRACE, out)
    run = json.loads((out / "run.json").read_text())
    run.setdefault("extra", {})["machine"] = machine
    run["engine"]["page_cache_budget"] = budget_bytes
    if budget_bytes is None:  # the exact path without a budget has no cache for a policy
        run["engine"]["cache_policy"] = None
    (out / "run.json").write_text(json.dumps(run))
    return out


pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="no committed validation trace")


def test_cores_and_quota_become_cpu_cores(tmp_path):
    base, _, _ = scenario_for(read_trace(_on_machine(tmp_path / "a", None)))
    assert base.hardware.cpu_cores == 2
    one, derived, _ = scenario_for(read_trace(_on_machine(
        tmp_path / "b", {"cpuset": {"cores": [0]}})))
    assert one.hardware.cpu_cores == 1 and "cpu_cores=1" in derived
    assert one.hardware.threads_share_one_core and not base.hardware.threads_share_one_core
    half, _, _ = scenario_for(read_trace(_on_machine(
        tmp_path / "c", {"cpu_quota": {"cores": 0.5}})))
    assert half.hardware.cpu_cores == 0.5
    # half a core's time, spread over both cores: the threads still hand work across cores
    assert half.hardware.thread_cores == 2 and not half.hardware.threads_share_one_core
    both, _, _ = scenario_for(read_trace(_on_machine(
        tmp_path / "d", {"cpuset": {"cores": [0]}, "cpu_quota": {"cores": 1.5}})))
    assert both.hardware.cpu_cores == 1  # a quota above the cores it may use adds nothing
    assert both.hardware.threads_share_one_core


def test_memory_limit_sets_the_page_cache_to_what_it_leaves(tmp_path):
    group = 300 * MIB
    machine = {"memory": {"limit_bytes": group + 100 * MIB, "own_bytes_at_entry": 100 * MIB,
                          "group_limit_bytes": group}}
    sc, derived, notes = scenario_for(read_trace(_on_machine(tmp_path / "m", machine)))
    paged = sc.model.device_bundle_bytes or sc.model.bundle_bytes
    held = int(group // paged) * sc.model.bundle_bytes  # whole bundles, as the engine charges
    assert budget(sc).page_cache == pytest.approx(held, abs=sc.model.bundle_bytes)
    assert f"page cache = {group} bytes" in derived
    assert any("memory limit" in n for n in notes)
    # the kernel reclaims in the reading thread at the group's limit; no budget drops
    assert sc.direct_reclaim and sc.budget_evict_ms == 0.0
    plain, _, _ = scenario_for(read_trace(_on_machine(tmp_path / "p", {})))
    assert not plain.direct_reclaim
    # an engine page-cache budget, where there is one, is what the page cache holds
    sc2, _, _ = scenario_for(read_trace(_on_machine(tmp_path / "n", machine, 64 * MIB)))
    assert budget(sc2).page_cache < budget(sc).page_cache


def test_memory_the_process_allocated_inside_is_not_page_cache(tmp_path):
    group = 300 * MIB
    machine = {"memory": {"limit_bytes": group + 100 * MIB, "own_bytes_at_entry": 100 * MIB,
                          "group_limit_bytes": group, "own_bytes_at_exit": 140 * MIB}}
    _, derived, _ = scenario_for(read_trace(_on_machine(tmp_path / "g", machine)))
    assert f"page cache = {group - 40 * MIB} bytes" in derived
