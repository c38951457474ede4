"""Decoding with the prerouter (engine.prerouter): the double shift (layer N's head at token t
routes layer N+1 at token t+1) checked on recorded decode calls, every path giving the same
tokens under prerouting, the resident model fed the same routing and a whole-sequence
reference, staging without host syncs of the router, per-request reset, loads labelled with
their step, and the simulator replaying such a trace. The heads themselves:
test_prerouter_heads.py."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from layer_reference import stacked_reference
from mlx.utils import tree_flatten
from prerouter_helpers import PROMPT, _heads, _np_head

from contract.engine_config import EngineConfig
from contract.errors import BadInput
from engine.generate import generate
from engine.loader import load_resident, load_streaming, streaming_blocks
from engine.manifest import read_manifest
from engine.prerouter import Prerouter, owners_for


def test_decode_routes_consumers_by_the_previous_tokens_head(tiny_random_converted, tmp_path):
    """Recorded per call: each owner's input and ids. At decode call c, consumer N+1's ids must
    be the top-K of head_N on call c-1's (x_N, ids_N) and call c-2's ids_N, computed here in
    numpy; the first MoE layer keeps its router."""
    heads = _heads(tiny_random_converted, tmp_path / "pre")
    pre = Prerouter.load(heads)
    eng = load_streaming(tiny_random_converted,
                         config=EngineConfig.from_preset("on-demand",
                         prerouter=str(heads)))
    model, tok = eng.model, eng.tokenizer
    link = eng.runtime.preroute
    seen: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
    observe = link.observe

    def spy(layer, x, inds):
        if layer == link.first:
            seen.append({})
        seen[-1][layer] = (np.array(x).reshape(-1, x.shape[-1])[-1],
                           np.array(inds).reshape(-1, inds.shape[-1]))
        observe(layer, x, inds)

    link.observe = spy
    r = generate(model, tok, PROMPT, 6, stop_at_eos=False, runtime=eng.runtime, lookahead=False)
    eng.close()
    assert len(r.tokens) == 6 and len(seen) >= 7
    k = pre.spec.top_k
    checked = 0
    for c in range(1, len(seen)):
        for n in pre.spec.owners:
            x, ids = seen[c - 1][n]
            prev = seen[c - 2][n][1][-1:] if c >= 2 else ids[-2:-1]
            logits = _np_head(pre.head(n), x[None].astype(np.float64), ids[-1:],
                              prev if len(prev) else None)[0]
            used = seen[c][n + 1][1]
            if used.shape[0] != 1:
                continue  # a multi-token call routes itself
            want = set(np.argsort(-logits)[:k].tolist())
            assert set(used[0].tolist()) == want, (c, n)
            checked += 1
    assert checked >= 5 * len(pre.spec.owners)


@pytest.mark.parametrize("fixture", ["tiny_random_converted", "tiny_grouped_converted"])
def test_every_path_gives_the_same_tokens_under_prerouting(fixture, request, tmp_path):
    root = request.getfixturevalue(fixture)
    heads = _heads(root, tmp_path / "pre", seed=1)
    tokens, stats = {}, {}
    for preset in ("on-demand", "hot", "staged"):
        eng = load_streaming(root, config=EngineConfig.from_preset(preset, prerouter=str(heads)))
        model, tok = eng.model, eng.tokenizer
        tokens[preset] = generate(model, tok, PROMPT, 12, stop_at_eos=False,
                                  runtime=eng.runtime).tokens
        stats[preset] = eng.runtime.stats.snapshot()
        assert eng.runtime.config.lead == 1
        eng.close()
    assert tokens["hot"] == tokens["on-demand"] == tokens["staged"]
    # Staged consumers never bring router ids to the host: per single-token call only the
    # MoE layers without a head before them sync (12 tokens = 12 single-token calls).
    m = read_manifest(root)
    unpredicted = len(m.moe_layers) - len(owners_for(m.moe_layers))
    s = stats["staged"]
    assert s["route_syncs"] + s["deferred_syncs"] == unpredicted * 12
    assert s["cache_hits"] + s["cache_misses"] >= m.top_k * 12 * len(m.moe_layers)


class _Forced:
    """A resident MoE block fed recorded routing instead of its router."""

    def __init__(self, block, layer: int, routes: list, call: list[int]):
        self.block, self.layer, self.routes, self.call = block, layer, routes, call

    def __call__(self, x):
        inds, weights = self.routes[self.call[0]][self.layer]
        y = self.block.switch_mlp(x, inds)  # mlx-lm's own QuantizedSwitchGLU, all experts
        return (y * weights[..., None]).sum(axis=-2)


def test_staged_prerouter_equals_the_resident_model_fed_the_same_routing(
        tiny_random_converted, tmp_path):
    """Independent reference: the fully loaded mlx-lm model, its MoE blocks fed the routing the
    streaming run used call by call, gives the same greedy tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    heads = _heads(tiny_random_converted, tmp_path / "pre", seed=2)
    eng = load_streaming(tiny_random_converted, config=EngineConfig.from_preset(
                         "staged", prerouter=str(heads)))
    model, tok = eng.model, eng.tokenizer
    blocks = streaming_blocks(model)
    routes: list[dict[int, tuple[mx.array, mx.array]]] = []

    def on_routing(layer, inds, weights):
        if layer == min(blocks):
            routes.append({})
        routes[-1][layer] = (inds, weights)

    for b in blocks.values():
        b.on_routing = on_routing
    r = generate(model, tok, PROMPT, 8, stop_at_eos=False, runtime=eng.runtime, lookahead=False)
    eng.close()
    mx.eval([a for call in routes for pair in call.values() for a in pair])
    resident, _ = load_resident(tiny_random_converted)
    call = [0]
    for i in blocks:
        layer = resident.model.layers[i]
        layer.mlp = _Forced(layer.mlp, i, routes, call)
    ids = tok.encode(PROMPT)
    feeds = [ids[:-1], ids[-1:]] + [[t] for t in r.tokens[:-1]]  # engine: prompt[:-1] first
    assert len(feeds) == len(routes)
    cache = make_prompt_cache(resident)
    tokens = []
    for i, f in enumerate(feeds):
        call[0] = i
        out = resident(mx.array(f)[None], cache=cache)
        if i >= 1:
            tokens.append(int(mx.argmax(out[0, -1]).item()))
    assert tokens == r.tokens


def test_new_request_starts_without_predictions(tiny_random_converted, tmp_path):
    heads = _heads(tiny_random_converted, tmp_path / "pre", seed=3)
    cfg = EngineConfig.from_preset("staged", prerouter=str(heads))
    eng = load_streaming(tiny_random_converted, config=cfg)
    model, tok = eng.model, eng.tokenizer
    a = generate(model, tok, [5], 8, stop_at_eos=False, runtime=eng.runtime).tokens
    generate(model, tok, PROMPT, 8, stop_at_eos=False, runtime=eng.runtime)
    b = generate(model, tok, [5], 8, stop_at_eos=False, runtime=eng.runtime).tokens
    eng.close()
    assert a == b


def test_engine_decode_equals_the_sequence_forward_under_predicted_routing(
        tiny_random_converted, tmp_path):
    """forward_prerouted (the training-side reference: whole sequence at once, mlx-lm's
    resident experts) and the engine (token by token, staged slots, one flush per step)
    implement prediction-as-routing separately; from a one-token prompt (which routes itself,
    as position 0 does there) they give the same greedy tokens and close logits."""
    from engine.train.heads import forward_prerouted

    heads = _heads(tiny_random_converted, tmp_path / "pre", seed=4)
    eng = load_streaming(tiny_random_converted, config=EngineConfig.from_preset(
                         "staged", prerouter=str(heads)))
    model, tok = eng.model, eng.tokenizer
    r = generate(model, tok, [7], 10, stop_at_eos=False, runtime=eng.runtime)
    eng.close()
    resident, _ = load_resident(tiny_random_converted)
    logits = forward_prerouted(resident, Prerouter.load(heads), mx.array([[7] + r.tokens[:-1]]))
    assert np.array(logits[0].argmax(-1)).tolist() == r.tokens
    own = resident(mx.array([[7] + r.tokens[:-1]]))
    assert np.array(own[0].argmax(-1)).tolist() != r.tokens  # the routing did change


def test_predicted_layers_read_ahead_and_label_loads_with_their_step(tiny_random_converted,
                                                                     tmp_path):
    """Decode loads of consumer layers are prefetches (issued before their step computes);
    only the layers without a head read on demand."""
    heads = _heads(tiny_random_converted, tmp_path / "pre", seed=5)
    loads: list[dict] = []
    eng = load_streaming(tiny_random_converted, on_load=loads.append,
                         config=EngineConfig.from_preset("staged",
                         prerouter=str(heads)))
    model, tok = eng.model, eng.tokenizer
    steps: list[dict] = []
    generate(model, tok, PROMPT, 10, stop_at_eos=False, runtime=eng.runtime, on_step=steps.append)
    eng.close()
    decode = {s["step"] for s in steps if s["tokens"] == 1}
    consumers = set(Prerouter.load(heads).spec.consumers)
    rows = [r for r in loads if r["step"] in decode]
    assert rows
    assert {r["source"] for r in rows if r["layer"] in consumers} == {"prefetch"}
    assert {r["source"] for r in rows if r["layer"] not in consumers} <= {"demand"}


def test_predicted_layers_are_filled_while_the_next_step_is_built(tiny_random_converted,
                                                                  tmp_path, monkeypatch):
    """In the decode loop each predicted layer's fill point is resolved by a staged call of
    the next step's build (engine.fill_points: one per layer), not left to the drain after
    the whole build, which would hand the step's last layers to the compute thread only
    once the next step's graph is done. Counted over every decode step but the last (no next
    step is built after it)."""
    import engine.fill_points as fp

    heads = _heads(tiny_random_converted, tmp_path / "pre")
    eng = load_streaming(tiny_random_converted,
                         config=EngineConfig.from_preset("staged", prerouter=str(heads)))
    resolved: list[bool] = []  # per resolved point: inside a build (collecting) or not
    real = fp.FillPoints._resolve_head

    def spy(self, *args, **kwargs):
        resolved.append(self.active)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(fp.FillPoints, "_resolve_head", spy)
    n = 8
    generate(eng.model, eng.tokenizer, PROMPT, 4, stop_at_eos=False, runtime=eng.runtime)
    before = eng.runtime.stats.snapshot()
    resolved.clear()
    generate(eng.model, eng.tokenizer, PROMPT, n, stop_at_eos=False, runtime=eng.runtime)
    d = eng.runtime.stats.delta(eng.runtime.stats.snapshot(), before)
    layers, k = len(eng.store.manifest.moe_layers), eng.store.manifest.top_k
    eng.close()
    # n steps (the last prompt token's and n - 1 decode steps), each of `layers` points:
    # begin() resolves two of each (the routed head, the first predicted layer) outside any
    # build; the rest are resolved inside the next step's build, but the last step's by drain
    assert resolved.count(True) == (n - 1) * (layers - 2)
    assert resolved.count(False) == 2 * n + (layers - 2)
    # the routed head's reads, started by begin and waited for by its fill, are one host
    # sync and K lookups a step, as a fill of its own would be
    assert d["route_syncs"] == 0 and d["deferred_syncs"] == n
    assert d["cache_hits"] + d["cache_misses"] == n * layers * k


def test_sim_compare_replays_a_prerouter_trace(tiny_random_converted, tmp_path):
    """A trace captured with heads replays under the simulator's staged path with lead token, its
    consumer layers taken from the heads' prerouter.json; unreadable heads are bad input."""
    from engine.capture import capture, load_engine, start_recorder
    from sim.compare import compare, scenario_for
    from traces.reader import read_trace

    heads = _heads(tiny_random_converted, tmp_path / "pre", seed=6)
    out = tmp_path / "trace"
    eng = load_engine(tiny_random_converted, preset="staged", prerouter=heads)
    rec = start_recorder(out, eng, command=["test"])
    try:
        capture(eng, [PROMPT], 9, recorder=rec)
    finally:
        rec.close()
        eng.close()
    trace = read_trace(out)
    assert trace.run["engine"]["prerouter"] == str(heads)
    sc, derived, notes = scenario_for(trace)
    owners = Prerouter.load(heads).spec.owners
    assert (sc.path, sc.lead) == ("staged", "token") and "lead=token" in derived
    assert (sc.model.consumer_first, sc.model.consumer_last) == (owners[0] + 1, owners[-1] + 1)
    assert sc.model.heads == len(owners) and any("prediction heads" in n for n in notes)
    assert compare(trace).simulated["decode_tok_s"] > 0
    run = json.loads((out / "run.json").read_text())
    run["engine"]["prerouter"] = str(tmp_path / "gone")
    (out / "run.json").write_text(json.dumps(run))
    with pytest.raises(BadInput, match="cannot read"):
        scenario_for(read_trace(out))


def test_model_profile_reads_heads_from_the_model_directory(tiny_random_converted, model_copy):
    from sim.model_profile import profile_from_manifest

    root = model_copy(tiny_random_converted)
    assert profile_from_manifest(root)["consumer_first"][0] == -1
    _heads(root, root / "prerouter")
    owners = Prerouter.load(root / "prerouter").spec.owners
    p = profile_from_manifest(root)
    assert (p["consumer_first"][0], p["consumer_last"][0], p["heads"][0]) == (
        owners[0] + 1, owners[-1] + 1, len(owners))
    head = Prerouter.load(root / "prerouter").head(owners[0])
    weights = sum(v.size for _, v in tree_flatten(head.parameters()))
    assert p["head_bytes"][0] == 4 * weights
    # a step reads all but the one-hot table, and of the table 2K rows (a lookup)
    k = Prerouter.load(root / "prerouter").spec.top_k
    rows, width = head.table.shape
    assert p["head_read_bytes"][0] == 4 * (weights - rows * width + 2 * k * width)
    (root / "prerouter" / "prerouter.json").write_text("[]")
    with pytest.raises(BadInput, match="not a prerouter description"):
        profile_from_manifest(root)


def test_predicted_routing_and_expert_outputs_against_float64(tiny_random_converted, tmp_path):
    """The prerouter path against an independent float64 reference, call by call on the staged
    path inside the decode loop: each consumer layer's ids AND weights are the routing math
    (softmax-topk in numpy) of the head's float64 logits on the previous call's inputs, and the
    staged path's expert outputs are the dequantized float64 SwiGLU of those experts
    (relative L2 < 1%)."""
    from dequant_reference import swiglu_reference

    heads = _heads(tiny_random_converted, tmp_path / "pre")
    pre = Prerouter.load(heads)
    m = read_manifest(tiny_random_converted)
    d, k = m.config["hidden_size"], pre.spec.top_k
    normalize = bool(m.config.get("norm_topk_prob", False))
    eng = load_streaming(tiny_random_converted,
                         config=EngineConfig.from_preset("staged",
                         prerouter=str(heads)))
    model, tok = eng.model, eng.tokenizer
    link = eng.runtime.preroute
    calls: list[dict[int, dict]] = []
    observe = link.observe

    def spy(layer, x, inds):
        if layer == link.first:
            calls.append({})
        calls[-1].setdefault(layer, {}).update(x=x, ids=inds)
        observe(layer, x, inds)

    link.observe = spy
    for layer, block in streaming_blocks(model).items():
        def on_routing(i, inds, weights):
            calls[-1].setdefault(i, {})["w"] = weights
        block.on_routing = on_routing
        path = block.path
        if hasattr(path, "predicted"):
            def predicted(x, inds, early=False, _p=path, _orig=path.predicted, _l=layer):
                out = _orig(x, inds, early)
                calls[-1][_l]["out"] = out
                return out
            path.predicted = predicted
    generate(model, tok, PROMPT, 6, temp=1.0, seed=2, stop_at_eos=False, runtime=eng.runtime)
    eng.close()
    experts = {n: stacked_reference(tiny_random_converted / m.layers[n].file) for n in m.moe_layers}
    checked = 0
    for c in range(2, len(calls)):
        for n in pre.spec.owners:
            cur = calls[c].get(n + 1, {})
            if "out" not in cur:
                continue  # not a predicted call (prefill routes itself)
            x_n = np.array(calls[c - 1][n]["x"]).reshape(-1, d)[-1]
            ids_n = np.array(calls[c - 1][n]["ids"]).reshape(-1, k)[-1:]
            prev = np.array(calls[c - 2][n]["ids"]).reshape(-1, k)[-1:]
            logits = _np_head(pre.head(n), x_n[None].astype(np.float64), ids_n, prev)[0]
            g = np.exp(logits - logits.max())
            g /= g.sum()
            got_ids = np.array(cur["ids"]).reshape(-1)
            assert set(got_ids.tolist()) == set(np.argsort(-g)[:k].tolist()), (c, n)
            w_ref = g[got_ids] / (g[got_ids].sum() if normalize else 1.0)
            got_w = np.array(cur["w"]).reshape(-1).astype(np.float64)
            assert np.allclose(got_w, w_ref, rtol=1e-4, atol=1e-6), (c, n, got_w, w_ref)
            x = np.array(cur["x"]).reshape(1, d)
            ref = swiglu_reference(x, got_ids[None], experts[n + 1])
            y = np.array(cur["out"]).reshape(1, k, d).astype(np.float64)
            assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.01, (c, n)
            checked += 1
    assert checked >= 3 * len(pre.spec.owners)
