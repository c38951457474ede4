"""`ssdmoe advise`: the space counted by hand, the search against the exhaustive optimum, the
frontier and recommendation on hand-worked entries, the printed command run for real (its
trace replays as the very scenario advise predicted), and one line for each bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex

import pytest

from advise.frontier import Constraints, Entry, advise, binding
from advise.machine import Machine, load_machine
from advise.search import search
from advise.space import ARMS, Candidate, Space
from contract.errors import BadInput
from tests.cli_runner import run_cli


def _space(**kw) -> Space:
    return Space(arms=list(ARMS), ks=[4], heads_k={4}, default_readers=2, **kw)


def test_space_size_is_the_product_of_each_arms_axes():
    # on-demand 1; hot 5 pools x 4 readers x 4 policies; staged 3 headrooms x 4 x 4; the two
    # lead arms 2 headrooms (K, 2K: a lead needs at least K) x 4 x 4
    assert _space().size() == 1 + 5 * 4 * 4 + 3 * 4 * 4 + 2 * (2 * 4 * 4)
    # a page-cache budget evicts on every arm: on-demand gets the 4 policies
    assert _space(page_cache_budget=True).size() == 4 + 5 * 4 * 4 + 3 * 4 * 4 + 2 * (2 * 4 * 4)
    # no heads at K=2: the token lead is not a line there
    two = Space(arms=list(ARMS), ks=[2, 4], heads_k={4}, default_readers=2)
    assert ("staged-token", 2) not in two.lines() and ("staged-token", 4) in two.lines()
    assert two.axes("staged", 2)["headroom"] == [1, 2, 4]  # 0.5, 1, 2 x K
    assert two.axes("staged-layer", 2)["headroom"] == [2, 4]


def test_every_candidate_is_a_configuration_the_engine_accepts():
    from types import SimpleNamespace

    space = Space(arms=list(ARMS), ks=[1, 2, 4, 8], heads_k={1, 2, 4, 8}, default_readers=2)
    for arm, k in space.lines():
        model = SimpleNamespace(top_k=k, bundle_bytes=4096, num_experts=64,
                                layers={i: None for i in range(3)}, moe_layers=[0, 1, 2])
        for c in space.every(arm, k):
            c.engine_config(64 * 3 * 4096, "heads" if arm == "staged-token" else None,
                            None).validate(model)  # BadInput if the engine would refuse it


def test_candidate_is_the_engine_config_its_flags_give():
    from contract.engine_config import EngineConfig

    c = Candidate("staged-layer", 4, headroom=8, readers=3, cache_policy="lfu")
    cfg = c.engine_config(expert_bytes=1000, heads=None, page_cache_budget=250)
    assert (cfg.decode, cfg.lead_kind, cfg.staged_headroom, cfg.readers, cfg.cache_policy,
            cfg.top_k, cfg.page_cache_budget) == ("staged", "layer", 8, 3, "lfu", 4, 250)
    hot = Candidate("hot", 2, hot_fraction=0.5, readers=1, cache_policy="lru")
    assert hot.engine_config(2**20 * 10, None, None).hot_bytes == 5 * 2**20
    flags = hot.capture_flags(None, bundle_bytes=4096, expert_bytes=2**20 * 10)
    assert flags[flags.index("--hot-mb") + 1] == "5"
    assert EngineConfig.from_preset("hot", hot_bytes=5 * 2**20).hot_bytes == 5 * 2**20


def _fake(score_of):
    calls = []

    def predict(cands):
        calls.append(len(cands))
        return [{"status": "ok", "decode_tok_s": score_of(c), "peak_engine_bytes": 1}
                for c in cands]
    return predict, calls


def _separable(c: Candidate) -> float:
    """Each axis adds its own term: a coordinate search must find the exhaustive optimum."""
    v = {"on-demand": 10, "hot": 30, "staged": 20, "staged-layer": 25, "staged-token": 24}[c.arm]
    v += {None: 0, 0.05: 0, 0.1: 1, 0.25: 3, 0.5: 2, 1.0: 0.5}[c.hot_fraction]
    v += {None: 0, 1: 0, 2: 1, 4: 4, 6: 2}[c.readers]
    v += {None: 0, 2: 0, 4: 2, 8: 1}[c.headroom]
    v += {None: 0, "lru": 1, "lfu": 0, "least-stale": 1.5, "fifo": 0}[c.cache_policy]
    return v


def test_coordinate_search_finds_the_exhaustive_optimum_of_a_separable_score():
    space = _space()
    predict, _ = _fake(_separable)
    _, every = search(space, predict, lambda r: r["decode_tok_s"], exhaustive_limit=10**6)
    predict, calls = _fake(_separable)
    how, seen = search(space, predict, lambda r: r["decode_tok_s"], exhaustive_limit=10)
    assert how.startswith("coordinate search") and len(seen) < len(every)
    best = max(every, key=lambda c: every[c]["decode_tok_s"])
    assert max(seen, key=lambda c: seen[c]["decode_tok_s"]) == best
    assert best == Candidate("hot", 4, hot_fraction=0.25, readers=4, cache_policy="least-stale")
    assert len(calls) > 1  # batches, one per axis and pass


def test_coordinate_search_skips_what_the_score_forbids():
    predict, _ = _fake(lambda c: -math.inf if c.arm == "hot" else _separable(c))
    _, seen = search(_space(), predict, lambda r: r["decode_tok_s"], exhaustive_limit=10)
    best = max(seen, key=lambda c: seen[c]["decode_tok_s"])
    assert best == Candidate("staged-layer", 4, headroom=4, readers=4, cache_policy="least-stale")


def _entry(label: str, tok_s: float, mib: float, k: int = 4, **row) -> Entry:
    arm = label.split()[0]
    return Entry(Candidate(arm, k, readers=int(label.split()[1]) if " " in label else None),
                 {"status": "ok", "decode_tok_s": tok_s, "peak_engine_bytes": mib * 2**20,
                  **row})


def test_frontier_and_recommendation_hand_worked():
    a = _entry("hot 1", 100.0, 40)   # fastest, biggest
    b = _entry("hot 2", 99.5, 20)    # within 1% of a, half the memory: recommended
    c = _entry("staged 1", 90.0, 25)  # slower and bigger than b: not on the frontier
    d = _entry("on-demand", 50.0, 10)  # smallest: on the frontier
    got = advise([a, b, c, d], "decode", Constraints())
    assert [e.frontier for e in (a, b, c, d)] == [True, True, False, True]
    assert got.recommended is b
    # a ceiling under b's memory: the memory binds, and the sentence says what it costs
    got = advise([a, b, c, d], "decode", Constraints(max_engine_bytes=15 * 2**20))
    assert got.recommended is d and got.reason.startswith("memory: hot, K=4, readers 1 would "
                                                          "reach 100.0 tok/s but needs 40 MiB")
    none = advise([a, b], "decode", Constraints(max_engine_bytes=2**20))
    assert none.recommended is None
    assert none.reason == ("--max-memory 1 MiB binds: the smallest engine allocation is 20.0 MiB "
                           "(hot, K=4, readers 2)")


@pytest.mark.parametrize(("row", "word"), [
    ({"blocked_ms_per_step": 6.0, "device_busy_fraction": 0.9}, "bandwidth"),
    ({"blocked_ms_per_step": 6.0, "device_busy_fraction": 0.1, "loads_per_step": 12}, "per-IO"),
    ({"blocked_ms_per_step": 0.5, "build_ms_per_step": 6.0, "eval_ms_per_step": 3.0}, "CPU"),
    ({"blocked_ms_per_step": 0.5, "build_ms_per_step": 2.0, "eval_ms_per_step": 7.0}, "compute"),
])
def test_binding_resource_from_the_step(row, word):
    e = _entry("hot 1", 100.0, 10, **row)  # a 10 ms step
    assert binding(e).startswith(word)


def test_a_read_throttle_binds_while_the_device_idles():
    # 0.5 MiB cold per 10 ms step = 52 MB/s against a 60 MB/s throttle: bandwidth, though the
    # device itself is busy 5% of the time
    e = _entry("hot 1", 100.0, 10, blocked_ms_per_step=6.0, device_busy_fraction=0.05,
               mib_per_step=1.0, cold_fraction=0.5, loads_per_step=8)
    assert binding(e, read_mbps=60).startswith("bandwidth: cold reads use 52 of the 60 MB/s")
    assert binding(e, read_mbps=200).startswith("per-IO cost")
    assert binding(e).startswith("per-IO cost")


def test_machines_file_reads_and_rejects(tmp_path):
    m = load_machine(_machines(tmp_path), "q")
    assert m == Machine(name="q", page_cache_fraction=0.25, read_mbps=100.0, cpus=1)
    assert m.flags() == ["--cpus", "1", "--page-cache-fraction", "0.25", "--read-mbps", "100"]
    assert m.run_extra()["machine"] == {"cpuset": {"cores": [0]}}
    with pytest.raises(BadInput, match=r"machines.toml: no machine 'z' \(machines: q, bad\)$"):
        load_machine(_machines(tmp_path), "z")
    with pytest.raises(BadInput, match=r"machines.bad: unknown key 'speed'"):
        load_machine(_machines(tmp_path), "bad")


def _machines(tmp_path):
    p = tmp_path / "machines.toml"
    p.write_text('[machines.q]\ncpus = 1\npage_cache = "1/4"\nread_mbps = 100\n'
                 '[machines.bad]\nspeed = 3\n')
    return p


ADVISE = ("--arm", "on-demand", "--arm", "hot", "--arm", "staged", "--decode-steps", "40",
          "--prompt-tokens", "8", "--workers", "1")


def test_advise_prints_the_best_and_writes_json_and_plot(tiny_random_converted, tmp_path,
                                                        monkeypatch, capsys):
    out = tmp_path / "adv"
    code, text, err = run_cli(monkeypatch, capsys, "advise", str(tiny_random_converted),
                              *ADVISE, "--page-cache-fraction", "0.5", "--out", str(out))
    assert code == 0, err
    data = json.loads((out / "advise.json").read_text())
    assert (out / "frontier.png").stat().st_size > 0
    rec = data["recommended"]
    ok = [c for c in data["candidates"] if c["excluded"] is None]
    top = max(c["predicted"]["decode_tok_s"] for c in ok)
    assert rec["predicted"]["decode_tok_s"] >= 0.99 * top  # advise.frontier.TIE
    near = [c for c in ok if c["predicted"]["decode_tok_s"] >= 0.99 * top]
    assert rec["predicted"]["peak_engine_bytes"] == min(c["predicted"]["peak_engine_bytes"]
                                                         for c in near)
    assert f"recommended: {rec['label']}" in text and rec["why"] in text
    assert rec["commands"]["capture"] in text and rec["commands"]["serve"] in text
    assert len(data["candidates"]) == 4 + 5 * 4 * 4 + 3 * 4 * 4  # on-demand has policies here


@pytest.mark.parametrize("cand", [
    Candidate("staged", 4, headroom=2, readers=1, cache_policy="lfu"),
    Candidate("staged-layer", 2, headroom=4, readers=3, cache_policy="least-stale"),
    Candidate("hot", 4, hot_fraction=0.1, readers=2, cache_policy="fifo"),
    Candidate("on-demand", 4, cache_policy="lru"),
])
def test_printed_command_runs_what_advise_predicted(cand, tiny_random_converted, tmp_path,
                                                    monkeypatch, capsys):
    """The command advise prints for a candidate, run for real, records the configuration
    advise simulated: its trace replays (sim compare) as the very scenario advise built."""
    from advise.model import load_model
    from advise.predict import Setting, scenario
    from advise.report import commands
    from sim.compare import scenario_for
    from sim.memory_budget import budget
    from traces.reader import read_trace

    setting = Setting(load_model(str(tiny_random_converted)), Machine(page_cache_fraction=0.5),
                      prompt_tokens=8, decode_steps=40)
    cmd = shlex.split(commands(setting, Entry(cand, {}))["capture"])
    assert cmd[:3] == ["ssdmoe", "capture", str(tiny_random_converted)]
    trace = tmp_path / "trace"
    cmd[cmd.index("--out") + 1] = str(trace)
    code, _, err = run_cli(monkeypatch, capsys, *cmd[1:], "--max-tokens", "2", "--no-progress")
    assert code == 0, err
    replayed, _, _ = scenario_for(read_trace(trace))
    predicted = scenario(setting, cand)
    for f in ("path", "lead", "k", "readers", "lru_bytes", "staged_headroom", "cache_policy",
              "lookahead", "help_reads", "gil", "o_direct", "engine_budget", "budget_evict_ms"):
        assert getattr(predicted, f) == getattr(replayed, f), f
    for f in ("throttle_read_mbps", "cpu_cores", "ram_gib"):
        assert getattr(predicted.hardware, f) == getattr(replayed.hardware, f), f
    # the page cache holds the budget's bundles (the OS reserve differs by the runs' KV)
    assert budget(predicted).page_cache == pytest.approx(budget(replayed).page_cache, abs=1)
    assert dataclasses.asdict(predicted.model) == dataclasses.asdict(replayed.model)


@pytest.mark.parametrize(("args", "line"), [
    (("--max-memory", "1K"), r"^error: advise: no configuration meets the constraints: "
                             r"--max-memory 0 MiB binds: the smallest engine allocation is "),
    (("--arm", "staged-token"), r"^error: --arm staged-token: no prerouter heads for K=4 in "),
    (("--objective", "speed"), r"^error: --objective 'speed': one of decode, prefill$"),
    (("--hardware", "no-such-machine"), r"^error: .*no-such-machine"),
    (("--set", "ram_gib=-1"), r"^error: .*ram_gib"),
    (("--machine", "one-core", "--cpus", "2"), r"^error: --machine one-core and --cpus: give "),
])
def test_bad_input_is_one_line(tiny_random_converted, tmp_path, monkeypatch, capsys, args, line):
    code, _, err = run_cli(monkeypatch, capsys, "advise", str(tiny_random_converted), *ADVISE,
                           "--out", str(tmp_path / "o"), *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert __import__("re").match(line, err.strip()), err


def test_a_profile_missing_a_value_is_one_line(tiny_random_converted, tmp_path, monkeypatch,
                                               capsys):
    from sim.profiles import ROOT

    text = (ROOT / "hardware" / "this-machine.toml").read_text()
    kept = [ln for ln in text.splitlines() if not ln.startswith("ssd_bandwidth_gbps")]
    (tmp_path / "partial.toml").write_text("\n".join(kept) + "\n")
    code, _, err = run_cli(monkeypatch, capsys, "advise", str(tiny_random_converted), *ADVISE,
                           "--hardware", str(tmp_path / "partial.toml"), "--out", str(tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "partial.toml" in err and "ssd_bandwidth_gbps" in err, err


def test_no_heads_for_a_k_on_the_profile_and_ray_missing(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "advise", "edge0-35b", "--hardware", "m2-16gb",
                           "--arm", "staged-token", "--k", "2", "--out", str(tmp_path))
    assert code == 2 and "no prerouter heads for K=2" in err and "heads for K=4" in err, err
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # import ray -> ImportError
    code, _, err = run_cli(monkeypatch, capsys, "advise", "edge0-35b", "--backend", "ray",
                           "--out", str(tmp_path))
    assert code == 2 and err.strip() == ("error: --backend ray: Ray is not installed (install "
                                         "the extra: uv sync --extra ray)"), err


def test_routing_trace_replays_at_its_k(tiny_random_converted, tmp_path, monkeypatch, capsys):
    trace = tmp_path / "t"
    code, _, err = run_cli(monkeypatch, capsys, "capture", str(tiny_random_converted), "--out",
                           str(trace), "--max-tokens", "3", "--no-progress")
    assert code == 0, err
    code, _, err = run_cli(monkeypatch, capsys, "advise", str(tiny_random_converted), *ADVISE,
                           "--arm", "on-demand", "--routing", str(trace), "--out",
                           str(tmp_path / "a"))
    assert code == 0, err
    data = json.loads((tmp_path / "a" / "advise.json").read_text())
    k = str(json.loads((trace / "run.json").read_text())["engine"]["k"])
    assert data["routing"][k] == f"routing replayed from {trace}"
    steps = {c["predicted"]["status"] for c in data["candidates"]}
    assert steps == {"ok"}
    code, _, err = run_cli(monkeypatch, capsys, "advise", str(tiny_random_converted), *ADVISE,
                           "--routing", str(trace), "--routing", str(trace), "--out",
                           str(tmp_path / "b"))
    assert code == 2 and f"a second trace at K={k}" in err, err


def test_ray_backend_gives_the_local_predictions(tiny_random_converted, tmp_path, monkeypatch,
                                                 capsys):
    from sim.sweep_ray import ray_module

    try:
        ray_module()
    except BadInput:
        pytest.skip("the ray extra is not installed")
    args = ("advise", str(tiny_random_converted), "--arm", "on-demand", "--page-cache-fraction",
            "0.5", "--decode-steps", "40", "--prompt-tokens", "8")
    rows = {}
    for backend in ("local", "ray"):
        code, _, err = run_cli(monkeypatch, capsys, *args, "--backend", backend, "--out",
                               str(tmp_path / backend))
        assert code == 0, err
        rows[backend] = json.loads((tmp_path / backend / "advise.json").read_text())
    assert len(rows["ray"]["candidates"]) == 4  # the four policies of the page-cache budget
    assert [c["predicted"] for c in rows["ray"]["candidates"]] == \
        [c["predicted"] for c in rows["local"]["candidates"]]


def test_advice_that_takes_memory_from_other_processes_says_so(tmp_path, monkeypatch, capsys):
    """An OS reserve that leaves the engine no room gives way (down to os_floor_gib): the
    recommendation then says how much of it the other processes keep."""
    args = ("advise", "edge0-35b", "--hardware", "m2-16gb", "--arm", "on-demand", "--k", "4",
            "--decode-steps", "10", "--workers", "1", "--out", str(tmp_path))
    code, text, err = run_cli(monkeypatch, capsys, *args, "--set", "os_reserve_gib=15")
    assert code == 0, err
    line = next(t for t in text.splitlines() if t.startswith("memory: "))
    assert "gave way under memory pressure" in line and "of their 15.00 GiB" in line, text
    code, text, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and "memory: " not in text, text
