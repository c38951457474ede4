"""validate --transfer's machines file (validation.transfer): the committed file loads into the
points the issue asks for; each machine becomes the capture flags it says; what is wrong is one
line naming the file and the key; the summary's errors and targets by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.errors import BadInput
from validation.transfer import Machine, drift, drift_text, load_machines, summary

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "scenarios" / "transfer" / "machines.toml"


def test_committed_machines_cover_what_transfer_must_show():
    plan = load_machines(COMMITTED)
    by = plan.machines
    emulated = {p.machine.name for p in plan.points
                if p.k == "native" and p.machine.name != "base-quarter"}
    assert len(emulated) >= 5
    assert any(by[m].cpus == 1 for m in emulated)
    assert any(by[m].cpu_quota == 0.5 for m in emulated)
    assert {by[m].page_cache_share for m in emulated} >= {0.5, 0.25}
    assert any(by[m].read_mbps and (by[m].page_cache_share or by[m].cpus) for m in emulated)
    wide = [p for p in plan.points if p.model.name == "tiny-trained-wide-stream"]
    assert "base-quarter" in {p.machine.name for p in wide}
    assert len({p.machine.name for p in wide} - {"base-quarter"}) >= 2
    tiny = [p for p in plan.points if p.model.name == "tiny-trained-stream"]
    assert {p.k for p in tiny} >= {"2", "8"}
    assert len({p.name for p in plan.points}) == len(plan.points)


def test_machine_flags():
    m = Machine("x", cpus=1, cpu_quota=0.5, page_cache_share=0.25, read_mbps=100)
    assert m.flags(own_bytes=100, experts=1000) == [
        "--cpus", "1", "--cpu-quota", "0.5", "--mem-limit", "350", "--read-mbps", "100"]
    assert Machine("y", page_cache="1/4").flags(0, 1000) == ["--page-cache-fraction", "0.25"]
    assert Machine("z").flags(0, 1000) == []


@pytest.mark.parametrize("text, msg", [
    ('[machines.a]\ncpus = 1\nram = 3\n', "machines.a: unknown key 'ram'"),
    ('[machines.a]\ncpus = "one"\n', "cpus 'one': expected int"),
    ('[machines.a]\npage_cache = "1/3"\n', "page_cache '1/3'"),
    ('[machines.a]\npage_cache_share = 2\n', "page_cache_share 2"),
    ('[machines.a]\n[[points]]\nmodel = "m"\nmachines = ["b"]\n', "machine 'b' is not in"),
    ('[machines.a]\n[[points]]\nmodel = "m"\nmachines = ["a"]\nspeed = 1\n',
     "points #1: unknown key 'speed'"),
    ('[machines.a]\n[[points]]\nmodel = "m"\nmachines = ["a"]\npaths = ["warp"]\n',
     "path 'warp'"),
    ('[machines.a]\n', "no [[points]]"),
    ('[oops]\n', "unknown section 'oops'"),
    ('machines = [', "not valid TOML"),
])
def test_bad_machines_file_is_one_line(tmp_path, text, msg):
    f = tmp_path / "m.toml"
    f.write_text(text)
    with pytest.raises(BadInput) as err:
        load_machines(f)
    assert msg in str(err.value) and str(f) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_machines_file_that_is_not_text_is_one_line(tmp_path):
    f = tmp_path / "m.toml"
    f.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(BadInput, match=f"^{f}: cannot read"):
        load_machines(f)


def _result(measured: float, simulated: float, comp: tuple[float, float] = (10, 10)) -> dict:
    r = {"decode_tok_s": {"measured": measured, "simulated": simulated},
         "cold_fraction": {"measured": 0.5, "simulated": 0.5}}
    for k in ("blocked_ms_per_step", "build_ms_per_step", "eval_ms_per_step"):
        r[k] = {"measured": comp[0], "simulated": comp[1]}
    return r


def test_summary_by_hand():
    rs = [_result(10, 11), _result(10, 9.5), _result(10, 10.2), _result(10, 13)]
    s = summary(rs)
    assert s["decode_abs_error_median_pct"] == pytest.approx(7.5)  # |10, 5, 2, 30| -> 7.5
    assert s["decode_abs_error_p90_pct"] == pytest.approx(30)
    assert s["component_abs_error_median_pct"] == pytest.approx(0)
    assert not s["met"]  # p90 30% > 15%
    assert summary([_result(10, 10.5)] * 3)["met"]
    # a component below 0.5 ms/step is not a percentage anyone can use
    assert summary([_result(10, 10, (0.1, 0.3))])["component_abs_error_median_pct"] != \
        summary([_result(10, 10, (0.1, 0.3))])["component_abs_error_median_pct"]  # nan


def test_drift_by_hand():
    """A profile's 1.0 GB/s kernel measured at 0.95 before the captures and 1.1 after: -5% and
    +10%, and the README's line says all three and both differences."""
    d = drift(1.0, 0.95, 1.1)
    assert d["before_pct"] == pytest.approx(-5.0) and d["after_pct"] == pytest.approx(10.0)
    text = drift_text(d)
    for part in ("1.000 GB/s", "0.950", "(-5.0%)", "1.100", "(+10.0%)"):
        assert part in text
    assert drift(0.0, 0.95, 1.1)["before_pct"] != drift(0.0, 0.95, 1.1)["before_pct"]  # nan


def test_cold_read_drift_by_hand():
    """A profile's 1.0 us a page measured at 1.4 before and 1.2 after: +40% and +20%, in the
    README's line; without the per-page figures the line is the kernel's alone."""
    d = drift(1.0, 1.0, 1.0, 1.0, 1.4, 1.2)
    assert d["cold_page_before_pct"] == pytest.approx(40.0)
    assert d["cold_page_after_pct"] == pytest.approx(20.0)
    text = drift_text(d)
    for part in ("1.000 us", "1.400", "(+40.0%)", "1.200", "(+20.0%)"):
        assert part in text
    assert "per page" not in drift_text(drift(1.0, 0.95, 1.1))


def test_a_repredicted_run_keeps_the_drift_measured_around_its_captures(tmp_path, monkeypatch):
    """Nothing left to capture: nothing measured now, and the README says what was measured
    around the captures (the earlier transfer.json's drift), not nothing."""
    from ssdmoe_cli import validate_cmd

    out = tmp_path / "tr"
    out.mkdir()
    earlier = drift(1.0, 0.9, 0.8, 1.0, 1.3, 1.5)
    (out / "transfer.json").write_text(json.dumps({"drift": earlier}))
    machines = tmp_path / "machines.toml"
    machines.write_text('[machines.one]\ncpus = 1\n\n[[points]]\nmodel = "m"\n'
                        'machines = ["one"]\npaths = ["on-demand"]\n')
    monkeypatch.setattr(validate_cmd, "_machine_now", lambda model: pytest.fail("measured"))
    monkeypatch.setattr("validation.transfer.check_models", lambda plan: None)
    monkeypatch.setattr("engine.machine_limits.check_available", lambda limits: None)
    monkeypatch.setattr("validation.transfer.captured", lambda where: True)
    monkeypatch.setattr("validation.transfer.run", lambda *a, **k: [])
    validate_cmd._transfer(machines, tmp_path / "m", out, fresh=False, calibrate=False,
                           rounds=1, max_tokens=8, prompts=1)
    assert json.loads((out / "transfer.json").read_text())["drift"] == earlier
    assert "(+30.0%)" in (out / "README.md").read_text()


def test_cli_refuses_flags_beside_the_machines_file(ssdmoe, tmp_path):
    r = ssdmoe("validate", "--transfer", str(COMMITTED), "--cpus", "1")
    assert r.returncode == 2 and "the machines file sets the machines" in r.stderr
    f = tmp_path / "bad.toml"
    f.write_text('[machines.a]\nram = 1\n')
    r = ssdmoe("validate", "--transfer", str(f))
    assert r.returncode == 2 and "unknown key 'ram'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
