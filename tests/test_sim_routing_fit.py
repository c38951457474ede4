"""Routing statistics fitted to traces (sim.routing_fit): the fit recovers the parameters of
routing generated with known ones, its per-K table interpolates between the captured K, and on
this project's captured traces (the fixture routed at K=2/4/8) the fitted generator reproduces
their bytes per step and hit rates within 10%."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.errors import BadInput
from sim.profiles import load_model
from sim.routing_fit import check, fit_trace, fit_trace_at, profile_values
from sim.routing_input import at_k
from sim.routing_synth import SynthRouting, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
CAPTURED = {k: ROOT / "reports" / "validation" / "traces" / f"on-demand-pc25-unthrottled{s}"
            for k, s in ((2, "-k2"), (4, ""), (8, "-k8"))}


def _synthetic(k: int, reuse: float, skew: float, steps: int = 600, seed: int = 3,
               recall: float = 0.0, window: int = 16):
    params = SynthRouting(layers=6, experts=64, k=k, steps=steps, skew=skew, reuse=reuse,
                          recall=recall, window=window, seed=seed)
    return synthetic_trace(params, bundle_bytes=61_440)


@pytest.mark.parametrize("reuse,skew", [(0.1, 0.4), (0.3, 1.2), (0.5, 0.0)])
def test_fit_at_a_known_recall_recovers_reuse_and_skew(reuse, skew):
    fit = fit_trace_at(_synthetic(4, reuse, skew, seed=11))  # another seed than the fit's own
    assert fit.reuse == pytest.approx(reuse, abs=0.02)
    assert fit.skew == pytest.approx(skew, abs=0.12)
    assert (fit.layers, fit.experts, fit.k, fit.tokens) == (6, 64, 4, 599)


@pytest.mark.parametrize("recall,window", [(0.0, 16), (0.65, 32)])
def test_fit_recovers_the_generators_multi_token_reuse(recall, window):
    trace = _synthetic(4, 0.15, 0.5, steps=500, seed=7, recall=recall, window=window)
    fit = fit_trace(trace, recalls=(0.0, 0.35, 0.65, 0.9), windows=(8, 32, 128))
    assert fit.recall == pytest.approx(recall, abs=0.3)
    if recall:
        assert fit.recall > 0 and fit.window == window
    # the fitted generator's novelty (independent seed) is the trace's within sampling noise
    assert max(abs(a - b) for a, b in zip(fit.novelty, fit.novelty_generated, strict=True)) \
        < 0.03
    plain = fit_trace_at(trace)  # adjacent reuse alone
    if recall:
        assert max(abs(a - b) for a, b in zip(plain.novelty, plain.novelty_generated,
                                              strict=True)) > 0.05


def test_profile_table_gives_each_captured_k_and_interpolates_between():
    fits = [fit_trace_at(_synthetic(k, 0.05 + 1.6 * k / 64, 1.0 - 0.05 * k, steps=800))
            for k in (8, 2, 4)]  # any order: the table is in ascending K
    values = profile_values(fits)
    assert values["routing_k"][0] == [2, 4, 8]
    m = load_model("edge0-35b")
    for key, (value, how) in values.items():
        setattr(m, key, value)
        assert how
    by_k = {f.k: f for f in fits}
    for k, f in by_k.items():  # a captured K gets its own fit
        reuse, skew, recall, window = at_k(m, k)
        assert (reuse, skew, recall, window) == pytest.approx(
            (round(f.reuse, 4), round(f.skew, 4), f.recall, f.window))
    # between K=4 and K=8: the midpoint; outside: the nearest captured K
    reuse6, skew6, _, _ = at_k(m, 6)
    assert reuse6 == pytest.approx((round(by_k[4].reuse, 4) + round(by_k[8].reuse, 4)) / 2)
    assert skew6 == pytest.approx((round(by_k[4].skew, 4) + round(by_k[8].skew, 4)) / 2)
    assert at_k(m, 1) == at_k(m, 2) and at_k(m, 16) == at_k(m, 8)
    with pytest.raises(BadInput, match="two traces routed at the same K"):
        profile_values([fits[0], fits[0]])


def test_a_profile_table_of_unequal_lengths_is_one_line(tmp_path):
    from sim.profiles import load_model as load

    text = (ROOT / "scenarios" / "models" / "edge0-35b.toml").read_text()
    bad = tmp_path / "m.toml"
    bad.write_text(text + "\nrouting_k = [2, 4]\nrouting_reuse = [0.1]\nrouting_skew = [0.5, 0.5]"
                   "\nrouting_recall = [0.0, 0.0]\nrouting_recall_window = [16, 16]\n")
    with pytest.raises(BadInput, match=r"m.toml: routing_reuse: 1 values for 2 K in routing_k"):
        load(str(bad))


def test_a_trace_too_short_to_fit_is_one_line():
    with pytest.raises(BadInput, match=r"20 adjacent decode tokens: too short to fit routing "
                                       r"statistics \(need at least 32\)$"):
        fit_trace_at(_synthetic(4, 0.2, 0.5, steps=21))


@pytest.mark.slow
@pytest.mark.skipif(not all((p / "run.json").is_file() for p in CAPTURED.values()),
                    reason="the validation traces are not in this checkout")
def test_the_fitted_generator_reproduces_captured_traces_within_10_percent():
    from traces.reader import read_trace

    traces = {k: read_trace(p) for k, p in CAPTURED.items()}
    fits = [fit_trace(t) for t in traces.values()]
    assert [f.k for f in fits] == [2, 4, 8]
    assert fits[0].reuse < fits[1].reuse < fits[2].reuse  # reuse grows with K (measured)
    for f in fits:  # the real routing reuses experts over many tokens: recall is fitted > 0
        assert f.recall > 0, f
    for f, (k, trace) in zip(fits, traces.items(), strict=True):
        # the engine's staged path (K + K slots per layer, the bundle LRU of this machine's
        # scenario) and the exact path (no app cache: the page cache sees every routed expert)
        for sets in (["path=staged"], ["path=exact"]):
            got = check(trace, f, "this-machine-tiny-trained", sets=sets)
            for name in ("mib_per_step", "page_cache_hit_rate", "app_cache_hit_rate"):
                measured, generated = got[name]["trace"], got[name]["generated"]
                if measured is None:  # the exact path has no app cache
                    assert generated is None
                    continue
                if (k, sets[0], name) == (8, "path=staged", "page_cache_hit_rate"):
                    # the one known miss (issue 12): at K=8 the K + K slots and the LRU hold
                    # more than the page cache (25% of experts), which then hits only for
                    # experts the app caches evicted first; 7% of loads measured, 5.4%
                    # generated (-22%, -0.015 absolute) on the pinned build
                    assert generated == pytest.approx(measured, abs=0.02), got
                    continue
                assert generated == pytest.approx(measured, rel=0.10), (k, sets, name, got)


@pytest.mark.slow
def test_profile_model_cli_fits_traces_per_k_and_sim_run_uses_them(ssdmoe, tmp_path,
                                                                    tiny_random_converted):
    """`sim profile-model --trace` writes one routing entry per traced K, which `sim run` with
    routing_stats=model then generates at each K (and between them)."""
    import json

    from traces.writer import write_tables

    manifest = json.loads((tiny_random_converted / "manifest.json").read_text())
    layers, experts = len(manifest["layers"]), manifest["num_experts"]
    dirs = []
    for k, reuse in ((2, 0.1), (4, 0.3)):
        params = SynthRouting(layers=layers, experts=experts, k=k, steps=160, skew=0.5,
                              reuse=reuse, recall=0.5, window=16, seed=k)
        t = synthetic_trace(params, bundle_bytes=manifest["bundle_bytes"])
        d = tmp_path / f"k{k}"
        write_tables(d, {"steps": t.steps, "routing": t.routing, "loads": t.loads},
                     {**t.run, "engine": {"k": k}})
        dirs.append(d)
    out = tmp_path / "models" / "mine.toml"
    r = ssdmoe("sim", "profile-model", str(tiny_random_converted), "--out", str(out),
               "--trace", str(dirs[0]), "--trace", str(dirs[1]))
    assert r.returncode == 0, r.stderr
    m = load_model(str(out))
    assert m.routing_k == [2, 4]
    assert m.routing_reuse == pytest.approx([0.1, 0.3], abs=0.03)
    assert all(x > 0 for x in m.routing_recall)  # the traces' multi-token reuse was found
    sc = tmp_path / "s.toml"
    sc.write_text(f'hardware = "this-machine"\nmodel = "{out}"\nrouting_stats = "model"\n'
                  "decode_steps = 200\n")
    for k, reuse in ((2, 0.1), (3, 0.2), (4, 0.3)):
        run = ssdmoe("sim", "run", str(sc), "--set", f"k={k}", "--json")
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["adjacent_overlap"] == pytest.approx(reuse, abs=0.04)


@pytest.mark.slow
def test_prerouted_traces_fit_their_own_table_and_the_token_lead_uses_it(
        ssdmoe, tmp_path, tiny_random_converted):
    """A trace run with prerouter heads routes by their predictions (more reuse than the
    model's own routers): `sim profile-model` fits it into the prerouted_ keys, and synthetic
    routing uses them for the token lead only."""
    import json

    from traces.writer import write_tables

    manifest = json.loads((tiny_random_converted / "manifest.json").read_text())
    layers, experts = len(manifest["layers"]), manifest["num_experts"]
    dirs = []
    for name, reuse, heads in (("own", 0.1, None), ("heads", 0.45, "models/x/prerouter")):
        params = SynthRouting(layers=layers, experts=experts, k=4, steps=160, skew=0.5,
                              reuse=reuse, recall=0.5, window=16, seed=1)
        t = synthetic_trace(params, bundle_bytes=manifest["bundle_bytes"])
        d = tmp_path / name
        write_tables(d, {"steps": t.steps, "routing": t.routing, "loads": t.loads},
                     {**t.run, "engine": {"k": 4, "prerouter": heads}})
        dirs.append(d)
    out = tmp_path / "models" / "mine.toml"
    r = ssdmoe("sim", "profile-model", str(tiny_random_converted), "--out", str(out),
               "--trace", str(dirs[0]), "--trace", str(dirs[1]))  # both at K=4: two tables
    assert r.returncode == 0, r.stderr
    m = load_model(str(out))
    assert m.routing_k == m.prerouted_routing_k == [4]
    assert m.routing_reuse == pytest.approx([0.1], abs=0.03)
    assert m.prerouted_routing_reuse == pytest.approx([0.45], abs=0.03)
    sc = tmp_path / "s.toml"
    sc.write_text(f'hardware = "this-machine"\nmodel = "{out}"\nrouting_stats = "model"\n'
                  'decode_steps = 200\npath = "staged"\n')
    heads = ["--set", "model.consumer_first=1", "--set", f"model.consumer_last={layers - 1}",
             "--set", f"model.heads={layers - 1}", "--set", "model.head_bytes=0"]
    for lead, reuse in (("none", 0.1), ("token", 0.45), ("layer", 0.1)):
        run = ssdmoe("sim", "run", str(sc), "--set", f"lead={lead}", *heads, "--json")
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["adjacent_overlap"] == pytest.approx(reuse, abs=0.05), lead


def test_profile_model_takes_the_graph_from_graph_of(ssdmoe, tmp_path, tiny_random_converted):
    """--graph-of: the profile names the model whose graph it shares and leaves the graph's
    figures to it (a calibration of that model gives them); an unknown one is one line."""
    models = tmp_path / "models"
    models.mkdir()
    base = models / "narrow.toml"
    r = ssdmoe("sim", "profile-model", str(tiny_random_converted), "--out", str(base),
               "--build-ms", "0.25")
    assert r.returncode == 0, r.stderr
    with base.open("a") as f:
        f.write("dispatch_cpu_ms_per_layer = 0.4  # test\n")
    out = models / "wide.toml"
    r = ssdmoe("sim", "profile-model", str(tiny_random_converted), "--out", str(out),
               "--graph-of", "narrow")
    assert r.returncode == 0, r.stderr
    assert "build_ms_per_layer" not in out.read_text()
    m = load_model(str(out))
    assert (m.graph_of, m.build_ms_per_layer, m.dispatch_cpu_ms_per_layer) == ("narrow", 0.25,
                                                                               0.4)
    bad = ssdmoe("sim", "profile-model", str(tiny_random_converted), "--out", str(out),
                 "--graph-of", "nothing")
    assert bad.returncode != 0 and "--graph-of nothing: no model profile" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
