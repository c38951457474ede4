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
    with pytest.raises(BadInput, match=r"s\.toml: ram_gib: 1\.0 GiB cannot hold the OS reserve "
                                       r".* and the resident weights"):
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
