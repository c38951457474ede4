"""Same-token lead (engine.layer_lead) and routing at another K (EngineConfig.top_k), each
checked against mlx-lm's own model: the resident QuantizedSwitchGLU model with its routers
rewired by hand (layer N+1's router fed layer N's MoE input on single-token calls), and the
resident model built with num_experts_per_tok = K. Plus the staged path's reads really
overlapping (issued at the previous layer's fill point), the trace recording both, and bad
input."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from contract.engine_config import EngineConfig
from engine.generate import generate
from engine.loader import load_resident, load_streaming, streaming_blocks
from engine.manifest import read_manifest

PROMPT = "Same token, one layer ahead: def f(x): return x + 1"


class _Gate(nn.Module):
    """An mlx-lm router that records its input (layer N's MoE input) and, for layer N+1 on a
    single-token call, routes layer N's recorded input instead of its own."""

    def __init__(self, inner, layer: int, seen: dict, previous: int | None):
        super().__init__()
        self.inner, self.layer, self.seen, self.previous = inner, layer, seen, previous

    def __call__(self, x):
        self.seen[self.layer] = x
        if self.previous is not None and x.shape[-2] == 1 and self.previous in self.seen:
            return self.inner(self.seen[self.previous])
        return self.inner(x)


def _rewired_resident(root):
    """mlx-lm's resident model with same-token lead routing wired into its own MoE blocks."""
    model, tok = load_resident(root)
    m = read_manifest(root)
    seen: dict = {}
    for i in m.moe_layers:
        block = model.layers[i].mlp
        prev = i - 1 if i - 1 in m.moe_layers else None
        block.gate = _Gate(block.gate, i, seen, prev)
    return model, tok


TEMP, SEED = 1.0, 3  # sampled: random-weight models' greedy text is one token repeated


def _mlx_lm_sampled(model, tok, prompt: str, n: int) -> list[int]:
    """mlx-lm's own generate_step at TEMP with SEED (the tokens follow the logits: equal
    tokens over a dozen sampled steps need equal distributions)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(SEED)
    return [int(t) for t, _ in generate_step(mx.array(tok.encode(prompt)), model, max_tokens=n,
                                              sampler=make_sampler(TEMP))]


@pytest.mark.parametrize("lookahead", [True, False])
def test_layer_lead_equals_mlx_lm_rewired(tiny_random_converted, lookahead):
    ref_model, tok = _rewired_resident(tiny_random_converted)
    want = _mlx_lm_sampled(ref_model, tok, PROMPT, 12)
    config = EngineConfig.from_preset("staged", lead_kind="layer", lookahead=lookahead)
    eng = load_streaming(tiny_random_converted, config=config)
    model, tok2 = eng.model, eng.tokenizer
    try:
        got = generate(model, tok2, PROMPT, 12, temp=TEMP, seed=SEED, stop_at_eos=False,
                       runtime=eng.runtime)
    finally:
        eng.close()
    assert got.tokens == want
    # negative control: the model's own routing gives other tokens on this prompt
    plain, tok3 = load_resident(tiny_random_converted)
    own = _mlx_lm_sampled(plain, tok3, PROMPT, 12)
    assert own != want, "same-token lead routing must differ from the model's own here"


def test_layer_lead_reads_start_at_previous_layer(tiny_random_converted):
    """Inside the decode loop layer N+1's reads are issued while layer N's fill point is
    resolved (before N's gather is queued), not at N+1's own point."""
    config = EngineConfig.from_preset("staged", lead_kind="layer")
    eng = load_streaming(tiny_random_converted, config=config)
    model, tok = eng.model, eng.tokenizer
    events: list[tuple[str, int]] = []
    try:
        rt = eng.runtime
        for layer, path in rt.staged("decode").items():
            fills, table = path.predicted_fill, path.slot_table
            orig_stage, orig_settle = fills.stage, table.settle

            def stage(inds, _l=layer, _f=orig_stage):
                events.append(("issue", _l))
                return _f(inds)

            def settle(tickets, _l=layer, _f=orig_settle):
                events.append(("wait", _l))
                return _f(tickets)

            fills.stage, table.settle = stage, settle
        generate(model, tok, PROMPT, 6, stop_at_eos=False, runtime=eng.runtime)
    finally:
        eng.close()
    m = read_manifest(tiny_random_converted)
    first = m.moe_layers[0]
    decode = events[events.index(("issue", first + 1)):]
    # in every step, layer N+1 is issued before layer N waits (N >= first)
    for n in m.moe_layers[:-1]:
        i_issue = decode.index(("issue", n + 1))
        i_wait = decode.index(("wait", n))
        assert i_issue < i_wait, f"layer {n + 1} issued after layer {n} waited: {decode[:20]}"


def test_layer_lead_fills_keep_pace_with_the_next_steps_build(tiny_random_converted):
    """In the lookahead loop step t's fill point of layer N is resolved while step t+1 is
    built, right after that step's layer N is built and before its layer N + 1 is: the
    predicted calls resolve points as routed calls do, not all after the whole graph."""
    config = EngineConfig.from_preset("staged", lead_kind="layer")
    eng = load_streaming(tiny_random_converted, config=config)
    model, tok = eng.model, eng.tokenizer
    events: list[tuple[str, int]] = []
    try:
        for layer, path in eng.runtime.staged("decode").items():
            orig_predicted, orig_settle = path.predicted, path.slot_table.settle

            def predicted(x, inds, early=False, _l=layer, _f=orig_predicted):
                events.append(("build", _l))
                return _f(x, inds, early)

            def settle(tickets, _l=layer, _f=orig_settle):
                events.append(("fill", _l))
                return _f(tickets)

            path.predicted, path.slot_table.settle = predicted, settle
        generate(model, tok, PROMPT, 8, stop_at_eos=False, runtime=eng.runtime)
    finally:
        eng.close()
    consumers = read_manifest(tiny_random_converted).moe_layers[1:]
    builds = [i for i, e in enumerate(events) if e == ("build", consumers[0])]
    assert len(builds) >= 4, events
    for start in builds[1:-1]:  # steps whose predecessor is being evaluated
        for n, after in zip(consumers[:-1], consumers[1:], strict=True):
            i = events.index(("build", n), start)
            j = events.index(("build", after), i)
            assert ("fill", n) in events[i:j], \
                f"layer {n}'s fill not between builds of {n} and {after}: {events[i:j + 1]}"


@pytest.mark.parametrize("k", [2, 8])
def test_top_k_equals_mlx_lm_at_that_k(tiny_random_converted, k):
    ref, tok = load_resident(tiny_random_converted, top_k=k)
    assert ref.layers[0].mlp.top_k == k
    want = _mlx_lm_sampled(ref, tok, PROMPT, 10)
    for preset in ("on-demand", "staged"):
        config = EngineConfig.from_preset(preset, top_k=k)
        eng = load_streaming(tiny_random_converted, config=config)
        model, tok2 = eng.model, eng.tokenizer
        seen = []
        for b in streaming_blocks(model).values():
            b.on_routing = lambda layer, inds, w, s=seen: s.append(inds.shape[-1])
        try:
            got = generate(model, tok2, PROMPT, 10, temp=TEMP, seed=SEED, stop_at_eos=False,
                           runtime=eng.runtime)
        finally:
            eng.close()
        assert set(seen) == {k}
        assert got.tokens == want, preset
    native = _mlx_lm_sampled(*load_resident(tiny_random_converted), PROMPT, 10)
    assert native != want, "K must change the tokens here (negative control)"


def test_trace_records_lead_and_k(tiny_random_converted, tmp_path, ssdmoe):
    out = tmp_path / "t"
    r = ssdmoe("capture", str(tiny_random_converted), "--out", str(out), "--max-tokens", "4",
               "--preset", "staged", "--lead", "layer", "--top-k", "2", "--no-progress")
    assert r.returncode == 0, r.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["engine"]["lead_kind"] == "layer"
    assert run["engine"]["k"] == 2 and run["engine"]["top_k"] == 2
    assert run["model"]["k"] == read_manifest(tiny_random_converted).top_k

    from traces.reader import read_trace

    routing = read_trace(out).routing
    assert set(len(e) for e in routing["experts"].to_list()) == {2}


@pytest.mark.parametrize("args,msg", [
    (["--top-k", "0"], "must be >= 1"),
    (["--top-k", "999"], "larger than the model"),
    (["--lead", "layer"], "staged decode path"),
    (["--lead", "sideways"], "unknown"),
    (["--lead", "token"], "needs prerouter heads"),
])
def test_bad_lead_and_k(tiny_random_converted, tmp_path, ssdmoe, args, msg):
    r = ssdmoe("capture", str(tiny_random_converted), "--out", str(tmp_path / "t"),
               "--max-tokens", "2", "--no-progress", *args)
    assert r.returncode == 2
    assert msg in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
