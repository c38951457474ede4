"""Profiles and scenarios: the shipped files load; bad input is one line naming file and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.errors import BadInput
from sim.profiles import ROOT, apply_overrides, load_hardware, load_model, load_scenario
from sim.replay import run_scenario
from traces.schema import SUMMARY_KEYS

HW = (ROOT / "hardware" / "m2-16gb.toml").read_text()


@pytest.mark.parametrize("path", sorted((ROOT / "hardware").glob("*.toml")), ids=lambda p: p.stem)
def test_hardware_profiles_load(path):
    hw = load_hardware(str(path))
    assert hw.name == path.stem


SOURCED = ["hardware/*.toml", "models/*.toml", "paper-*.toml"]


@pytest.mark.parametrize("path", sorted(p for g in SOURCED for p in ROOT.glob(g)),
                         ids=lambda p: p.stem)
def test_every_profile_value_cites_its_source(path):
    skip = ("description", "hardware", "model", "seed", "decode_steps")
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#") and not line.startswith(skip):
            assert "#" in line, f"{path.name}: value without a source comment: {line}"


@pytest.mark.parametrize("name", ["edge0-35b", "edge0-8b"])
def test_model_profiles_load(name):
    m = load_model(name)
    assert m.consumer_count > 0 and m.expert_bytes > 0


@pytest.mark.parametrize("name", ["paper-m2-16gb", "paper-m4pro-24gb"])
def test_paper_scenarios_load(name):
    sc = load_scenario(name)
    assert sc.model.name == "edge0-35b" and sc.k == 4 and sc.readers == 0


def test_the_8b_scenario_is_table_1s_second_tier_on_the_35b_machine():
    """The digest's 8B row: K=8, a shared LRU of 64 bundles, the 35B rows' M4 Pro profile and
    engine; the 1,024-bundle LRU of the same row is 16 times the bytes."""
    sc, big = load_scenario("paper-m4pro-24gb-8b"), load_scenario("paper-m4pro-24gb")
    assert sc.model.name == "edge0-8b" and sc.k == 8 and sc.model.layers == 24
    assert sc.lru_bytes == 64 * 1331692 == 64 * sc.model.bundle_bytes
    assert sc.hardware == big.hardware
    assert (sc.readers, sc.demand_pieces, sc.prefetch_pieces) == (
        big.readers, big.demand_pieces, big.prefetch_pieces)


def test_the_m2_os_reserve_leaves_the_prerouter_arm_the_page_cache_floor():
    """The M2's OS reserve is derived, not fitted (reports/paper, section 1): its page cache sat at
    the kernel's floor beside the prerouter engine's peak (the digest's 2.9 GiB plus the KV of a
    1,000-token run at 20 KiB/token), and the engine did not page."""
    from sim.memory_budget import budget
    from sim.scenario import GIB

    kv_gib = 1000 * 20 * 1024 / GIB
    by_hand = 16.0 - 2.9 - kv_gib - 0.5
    assert load_hardware("m2-16gb").os_reserve_gib == pytest.approx(by_hand, abs=0.01)
    for lead, at_floor in (("token", True), ("none", False)):
        mem = budget(load_scenario("paper-m2-16gb", [f"lead={lead}"]))
        assert mem.swapped == 0.0
        assert (mem.page_cache / GIB == pytest.approx(0.5, abs=0.01)) == at_floor


def _hw_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("edit, key, problem", [
    (lambda t: t.replace("queue_depth = 8", ""), "queue_depth", "missing"),
    (lambda t: t + "\nturbo = true\n", "turbo", "unknown key"),
    (lambda t: t.replace("ssd_bandwidth_gbps = 3.07", "ssd_bandwidth_gbps = -2"),
     "ssd_bandwidth_gbps", "must be > 0"),
    (lambda t: t.replace("queue_depth = 8", 'queue_depth = "deep"'), "queue_depth",
     "expected an integer"),
    (lambda t: t.replace("readahead = true", "readahead = 1"), "readahead", "true or false"),
])
def test_bad_hardware_profile_names_file_and_key(tmp_path, edit, key, problem):
    path = _hw_file(tmp_path, edit(HW))
    with pytest.raises(BadInput) as err:
        load_hardware(path)
    message = str(err.value)
    assert message.startswith(path) and f": {key}: " in message and problem in message
    assert "\n" not in message


def test_ram_smaller_than_resident_weights_is_bad_input(tmp_path):
    hw = _hw_file(tmp_path, HW.replace("ram_gib = 16.0", "ram_gib = 1.0"))
    scen = tmp_path / "s.toml"
    scen.write_text(f'hardware = "{hw}"\nmodel = "edge0-35b"\ndecode_steps = 2\n')
    sc = load_scenario(str(scen))
    with pytest.raises(BadInput, match=r"s\.toml: ram_gib: 1\.0 GiB cannot hold the OS floor "
                                       r"under pressure \(5\.80 GiB\) and the resident weights"):
        run_scenario(sc)


def test_scenario_missing_model_and_unknown_key(tmp_path):
    scen = tmp_path / "s.toml"
    scen.write_text('hardware = "m2-16gb"\n')
    with pytest.raises(BadInput, match=r"s\.toml: model: missing"):
        load_scenario(str(scen))
    scen.write_text('hardware = "m2-16gb"\nmodel = "edge0-35b"\nwarp = 9\n')
    with pytest.raises(BadInput, match=r"s\.toml: warp: unknown key"):
        load_scenario(str(scen))


def test_overrides_are_type_checked_and_routed_to_the_right_profile():
    sc = load_scenario("paper-m2-16gb")
    sc2 = apply_overrides(sc, ["k=8", "path=hot", "ram_gib=24", "lru_bytes=1.5GiB",
                               "ssd_bandwidth_gbps=7", "lead=layer", "lead_layers=2",
                               "readahead=false", "model.k=8"])
    assert (sc2.k, sc2.path, sc2.hardware.ram_gib, sc2.lru_bytes) == (8, "hot", 24.0,
                                                                    int(1.5 * 2**30))
    assert sc2.hardware.ssd_bandwidth_gbps == 7.0 and sc2.lead == "layer" and sc2.lead_layers == 2
    assert sc2.hardware.readahead is False and sc2.model.k == 8
    assert sc.k == 4 and sc.hardware.ram_gib == 16.0  # the original is untouched
    for bad, match in [("k=four", "k: expected an integer"),
                       ("path=magic", "path: 'magic' must be one of"),
                       ("policy=on-demand", "policy: renamed to the engine's names"),
                       ("lead=2", "lead: '2' must be one of none, token, layer"),
                       ("warp=1", "--set warp: unknown key"), ("ram_gib", "expected key=value"),
                       ("prediction_accuracy=1.5", "must be in"), ("gpu.x=1", "unknown section")]:
        with pytest.raises(BadInput, match=match):
            apply_overrides(sc, [bad])


def test_sim_run_cli_json_uses_summary_keys(ssdmoe, tmp_path):
    out = tmp_path / "simtrace"
    chrome = tmp_path / "t.json"
    result = ssdmoe("sim", "run", "paper-m2-16gb", "--set", "decode_steps=30", "--json",
                    "--out", str(out), "--chrome", str(chrome))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert list(data)[: len(SUMMARY_KEYS)] == list(SUMMARY_KEYS)
    assert data["decode_tok_s"] > 0 and data["sim_steps_per_s"] > 0
    # the written trace reads back with the same summary, as a simulated run
    summary = ssdmoe("trace", "summary", str(out), "--json")
    assert json.loads(summary.stdout) == {k: data[k] for k in SUMMARY_KEYS}
    assert json.loads((out / "run.json").read_text())["kind"] == "simulated"
    assert json.loads(chrome.read_text())["traceEvents"]


def test_sim_run_cli_bad_input_is_one_line(ssdmoe):
    result = ssdmoe("sim", "run", "paper-m2-16gb", "--set", "ssd_bandwidth_gbps=-1")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "ssd_bandwidth_gbps" in result.stderr and "must be > 0" in result.stderr
    missing = ssdmoe("sim", "run", "no-such-scenario")
    assert missing.returncode == 2 and "no-such-scenario.toml: no such profile" in missing.stderr


@pytest.mark.parametrize("engine, os_floor, held, page_cache, paged_out", [
    (3.0, 6.0, 12.0, 1.0, 0.0),   # room for all: the OS keeps its reserve
    (4.0, 6.0, 11.5, 0.5, 0.0),   # the page cache at its floor, then the OS gives 0.5 GiB
    (10.0, 6.0, 6.0, 0.5, 0.5),   # the OS at its floor: the engine's own 0.5 GiB pages out
    (4.0, -1.0, 12.0, 0.5, 0.5),  # an OS that does not give way: the engine pages at once
])
def test_the_os_gives_way_down_to_its_floor_before_the_engine_pages(engine, os_floor, held,
                                                                    page_cache, paged_out):
    """16 GiB of RAM, an OS reserve of 12 GiB, a page-cache floor of 0.5 GiB, worked by hand:
    the page cache gives way first, then the OS and other processes (down to their floor),
    then the engine's own memory."""
    from sim.memory_budget import MemoryBudget
    from sim.scenario import GIB

    g = lambda x: int(x * GIB)  # noqa: E731
    mem = MemoryBudget(ram=g(16), os_reserve=g(12), resident=g(engine), kv=0, heads=0,
                       adapter=0, lru=0, slots=0, slot_views=0, runtime=0, prefill_buffers=0,
                       page_cache_floor=g(0.5), os_floor=g(os_floor) if os_floor >= 0 else -1)
    assert (mem.os_held, mem.page_cache, mem.oversubscribed) == (g(held), g(page_cache),
                                                                  g(paged_out))
    assert mem.swapped == pytest.approx(paged_out / engine)


def test_the_m2_at_k8_compresses_the_desktop_session_instead_of_paging_the_engine():
    """The M2's K=8 engine does not fit beside the 12.58 GiB its desktop session held at K=4:
    macOS compresses the session's memory (down to the 5.8 GiB floor it kept under the M4 Pro's
    resident run) before it pages the engine. Without the floor the engine pages."""
    from sim.memory_budget import budget
    from sim.scenario import GIB

    for lead in ("token", "none"):
        mem = budget(load_scenario("paper-m2-16gb", ["k=8", f"lead={lead}"]))
        assert mem.swapped == 0.0 and mem.page_cache / GIB == pytest.approx(0.5)
        assert 5.8 < mem.os_held / GIB < 12.58
        assert mem.os_held + mem.engine + mem.page_cache == mem.ram
        stiff = budget(load_scenario("paper-m2-16gb", ["k=8", f"lead={lead}", "os_floor_gib=-1"]))
        assert stiff.swapped > 0.05 and stiff.os_held / GIB == pytest.approx(12.58)


def test_an_os_floor_is_checked(ssdmoe):
    above = ssdmoe("sim", "run", "paper-m2-16gb", "--set", "os_floor_gib=13")
    assert above.returncode != 0
    line = above.stderr.strip()
    assert "os_floor_gib: 13.0 GiB is above os_reserve_gib (12.58 GiB)" in line
    assert "\n" not in line and "Traceback" not in above.stderr
    bad = ssdmoe("sim", "run", "paper-m2-16gb", "--set", "os_floor_gib=-2")
    assert bad.returncode != 0 and "os_floor_gib: " in bad.stderr
    assert "must be -1 (does not give way) or >= 0" in bad.stderr
    small = ssdmoe("sim", "run", "paper-m2-16gb", "--set", "ram_gib=6")
    assert small.returncode != 0
    assert "cannot hold the OS floor under pressure (5.80 GiB) and the resident weights" \
        in small.stderr


def _model_toml(**over) -> str:
    values = dict(layers=2, experts=16, k=2, bundle_bytes=1024, resident_bytes=0,
                  active_params=1e6, kv_bytes_per_token=0, consumer_first=-1, consumer_last=-1,
                  heads=0, head_bytes=0, head_build_ms=0.0)
    values.update(over)
    return "".join(f"{k} = {json.dumps(v)}  # test\n" for k, v in values.items())


def test_a_model_takes_its_graphs_figures_from_graph_of(tmp_path):
    """The graph's figures come from the graph_of profile where the model does not set them
    (build 0.2, dispatch 0.4, the wait 0.1 from the narrow model; its own primitives win);
    its expert figures stay its own."""
    (tmp_path / "narrow.toml").write_text(_model_toml(
        build_ms_per_layer=0.2, dispatch_cpu_ms_per_layer=0.4, compute_wait_ms_per_layer=0.1,
        primitives_per_layer=100.0))
    (tmp_path / "wide.toml").write_text(_model_toml(
        bundle_bytes=4096, graph_of="narrow", primitives_per_layer=120.0))
    wide = load_model(str(tmp_path / "wide.toml"))
    assert (wide.build_ms_per_layer, wide.dispatch_cpu_ms_per_layer,
            wide.compute_wait_ms_per_layer) == (0.2, 0.4, 0.1)
    assert (wide.primitives_per_layer, wide.bundle_bytes, wide.graph_of) == (120.0, 4096,
                                                                              "narrow")


@pytest.mark.parametrize(("narrow", "wide", "says"), [
    (None, _model_toml(graph_of="nothing"), "graph_of: 'nothing': no such model profile"),
    (_model_toml(build_ms_per_layer=0.2, graph_of="wide"), _model_toml(graph_of="narrow"),
     "graph_of: 'narrow' names a graph_of profile itself ('wide')"),
])
def test_a_bad_graph_of_is_one_line(tmp_path, narrow, wide, says):
    if narrow is not None:
        (tmp_path / "narrow.toml").write_text(narrow)
    (tmp_path / "wide.toml").write_text(wide)
    with pytest.raises(BadInput) as err:
        load_model(str(tmp_path / "wide.toml"))
    assert says in str(err.value) and "wide.toml" in str(err.value)
    assert "\n" not in str(err.value)
