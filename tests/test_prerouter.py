"""The prerouter (engine.prerouter): the head's math against the paper's concatenated one-hot
form computed in numpy, the warm start, the double shift (layer N's head at token t routes
layer N+1 at token t+1) checked on recorded decode calls, every path giving the same tokens
under prerouting, staging without host syncs of the router, per-request reset, head training,
and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from layer_reference import stacked_reference
from mlx.utils import tree_flatten

from contract.engine_config import EngineConfig
from contract.errors import BadInput
from engine.generate import generate
from engine.loader import load_resident, load_streaming, streaming_blocks
from engine.manifest import read_manifest
from engine.prerouter import Prerouter, PrerouterHead, PrerouterSpec, owners_for, router_weight
from engine.train_heads import HeadsConfig, train_heads

PROMPT = "Prediction as routing: def g(n): return n * 2"


def _np_onehot(inds: np.ndarray, experts: int) -> np.ndarray:
    out = np.zeros(inds.shape[:-1] + (experts,))
    np.put_along_axis(out, inds.astype(np.int64), 1.0, axis=-1)
    return out


def _np_head(head: PrerouterHead, x, inds, prev) -> np.ndarray:
    """fc2(gelu(fc1(u))) + skip(u) on u = concat(x, onehot(t), onehot(t-1)), float64."""
    e, h = head.experts, head.hidden
    u = np.concatenate([x, _np_onehot(inds, e),
                        _np_onehot(prev, e) if prev is not None else np.zeros(x.shape[:-1] + (e,))],
                       axis=-1)
    w = np.concatenate([np.array(head.proj.weight), np.array(head.table).T], axis=1)  # [H+E, D+2E]
    z = u @ w.T.astype(np.float64) + np.array(head.proj.bias)
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))
    a = gelu(z[..., :h])
    return a @ np.array(head.fc2.weight).T + np.array(head.fc2.bias) + z[..., h:]


def _spec(m) -> PrerouterSpec:
    return PrerouterSpec(owners=owners_for(m.moe_layers), dims=m.config["hidden_size"],
                         experts=m.num_experts, top_k=m.top_k, hidden=16)


def _heads(root: Path, out: Path, seed: int = 0) -> Path:
    """Warm-started heads, then perturbed so that they differ from the next router."""
    m = read_manifest(root)
    eng = load_streaming(root)
    model = eng.model
    routers = {i: router_weight(b.gate) for i, b in streaming_blocks(model).items()}
    eng.close()
    pre = Prerouter.warm_started(_spec(m), routers, seed=seed)
    rng = np.random.default_rng(seed)
    for n in pre.spec.owners:
        head = pre.head(n)
        head.fc2.weight = mx.array(rng.normal(0, 0.5, head.fc2.weight.shape).astype(np.float32))
        head.table = head.table + mx.array(rng.normal(0, 0.5, head.table.shape)
                                           .astype(np.float32))
    pre.save(out)
    return out


def test_head_equals_the_concatenated_onehot_form():
    mx.random.seed(3)
    head = PrerouterHead(dims=24, experts=10, hidden=12)
    head.table = mx.random.normal(head.table.shape)
    head.proj.bias = mx.random.normal(head.proj.bias.shape)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    inds = np.stack([rng.choice(10, 3, replace=False) for _ in range(5)]).astype(np.uint32)
    prev = np.stack([rng.choice(10, 3, replace=False) for _ in range(5)]).astype(np.uint32)
    for p in (prev, None):
        got = np.array(head(mx.array(x), mx.array(inds), None if p is None else mx.array(p)))
        want = _np_head(head, x.astype(np.float64), inds, p)
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4), p is None


def test_warm_started_head_is_the_next_router():
    mx.random.seed(0)
    router = mx.random.normal((10, 24))
    head = PrerouterHead(dims=24, experts=10, hidden=12)
    head.warm_start(router)
    x = mx.random.normal((4, 24))
    inds = mx.array(np.tile(np.arange(3, dtype=np.uint32), (4, 1)))
    got = head(x, inds, inds + 3)
    assert np.allclose(np.array(got), np.array(x @ router.T), atol=1e-5)


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


def test_train_heads_improves_on_the_warm_start(tiny_random_converted):
    model, _ = load_resident(tiny_random_converted)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.args.vocab_size, 40 * 33).astype(np.int32)
    cfg = HeadsConfig(hidden=32, steps=80, batch=256, lr=3e-3, seq_len=32, train_windows=40,
                      eval_windows=40)
    pre = train_heads(model, tokens, tokens, cfg)
    rep = pre.spec.report
    assert pre.spec.owners == owners_for(list(range(len(model.model.layers))))
    assert rep["heldout"]["kl_mean"] < 0.8 * rep["heldout_before"]["kl_mean"]
    assert rep["heldout"]["head_recall_mean"] > rep["heldout_before"]["head_recall_mean"]
    assert rep["history"][-1]["loss"] < rep["history"][0]["loss"]


def test_cli_train_heads_then_generate(tiny_random_converted, model_copy, tmp_path, ssdmoe):
    root = model_copy(tiny_random_converted)
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"paragraph {i}: the quick brown fox {i * 7} jumps" * 8
                                for i in range(60)))
    args = ("train", "heads", str(root), "--text", str(text), "--steps", "5", "--hidden", "8",
            "--train-windows", "4", "--eval-windows", "2")
    r = ssdmoe(*args)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["out"] == str(root / "prerouter")
    meta = json.loads((root / "prerouter" / "prerouter.json").read_text())
    assert meta["report"]["heldout"]["per_head"] and meta["hidden"] == 8
    r = ssdmoe(*args)
    assert r.returncode == 2 and "already exists" in r.stderr
    r = ssdmoe("generate", str(root), "--prompt", "the quick", "--max-tokens", "4", "--preset",
               "staged", "--prerouter", str(root / "prerouter"), "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 4


def test_bad_prerouter_input(tiny_random_converted, tmp_path, ssdmoe):
    with pytest.raises(BadInput, match="prerouter.json: no such file"):
        load_streaming(tiny_random_converted,
                       config=EngineConfig.from_preset("staged", prerouter=str(tmp_path / "x")))
    m = read_manifest(tiny_random_converted)
    spec = _spec(m)
    spec.dims += 8  # heads for another model
    Prerouter(spec).save(tmp_path / "other")
    with pytest.raises(BadInput, match="heads are for"):
        load_streaming(tiny_random_converted, config=EngineConfig.from_preset(
            "staged", prerouter=str(tmp_path / "other")))
    heads = _heads(tiny_random_converted, tmp_path / "pre")
    (heads / "prerouter.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(BadInput, match="does not match"):
        Prerouter.load(heads)
    (heads / "prerouter.json").write_text("{")
    with pytest.raises(BadInput, match="not a prerouter description"):
        Prerouter.load(heads)
    r = ssdmoe("bench", str(tiny_random_converted), "--arms", "resident,staged-prerouter",
               "--prerouter", str(tmp_path / "none"))
    assert r.returncode == 2 and "no prerouter heads" in r.stderr


def test_stacked_heads_equal_each_head():
    """The one-flush batched form equals running each head on its own, with and without a
    previous token."""
    from engine.prerouter import StackedHeads

    mx.random.seed(5)
    spec = PrerouterSpec(owners=[0, 1, 2], dims=16, experts=8, top_k=2, hidden=6)
    pre = Prerouter(spec)
    for n in spec.owners:
        pre.head(n).table = mx.random.normal(pre.head(n).table.shape)
        pre.head(n).proj.bias = mx.random.normal(pre.head(n).proj.bias.shape)
    stacked = StackedHeads(pre)
    x = mx.random.normal((3, 16))
    ids = mx.array([[0, 5], [2, 3], [7, 1]], dtype=mx.uint32)
    prev = mx.array([[4, 6], [0, 0], [3, 2]], dtype=mx.uint32)
    rows = mx.concatenate([prev[0:1], stacked.no_prev(1, 2), prev[2:3]])
    got = np.array(stacked(x, ids, rows))
    want = [pre.head(0)(x[0:1], ids[0:1], prev[0:1]), pre.head(1)(x[1:2], ids[1:2], None),
            pre.head(2)(x[2:3], ids[2:3], prev[2:3])]
    assert np.allclose(got, np.array(mx.concatenate(want)), atol=1e-5)


def test_engine_decode_equals_the_sequence_forward_under_predicted_routing(
        tiny_random_converted, tmp_path):
    """forward_prerouted (the training-side reference: whole sequence at once, mlx-lm's
    resident experts) and the engine (token by token, staged slots, one flush per step)
    implement prediction-as-routing separately; from a one-token prompt (which routes itself,
    as position 0 does there) they give the same greedy tokens and close logits."""
    from engine.train_heads import forward_prerouted

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
