"""Routing math against a float64 NumPy reference (hypothesis), hand-worked examples, and
mlx-lm's own bailing_moe group selection."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from engine.archs import ARCHS, routing_spec
from engine.fixtures.random_models import small_config
from engine.routing import RoutingSpec, route, sigmoid_group, softmax_topk

TOL = 1e-5
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _check_topk(scores: np.ndarray, inds: np.ndarray, k: int) -> None:
    """`inds` is a valid top-k of `scores` per row (ties within TOL may go either way)."""
    for row, sel in zip(scores, inds, strict=True):
        assert len(set(sel.tolist())) == k
        rest = np.setdiff1d(np.arange(len(row)), sel)
        if len(rest):
            assert row[sel].min() >= row[rest].max() - TOL


logits_st = st.integers(1, 5).flatmap(
    lambda t: st.sampled_from([8, 16, 32]).flatmap(
        lambda e: arrays(np.float32, (t, e),
                         elements=st.floats(-8, 8, width=32, allow_subnormal=False))))


@SETTINGS
@given(logits=logits_st, k=st.integers(1, 8), normalize=st.booleans(),
       order=st.sampled_from(["last", "first"]))
def test_softmax_topk_matches_reference(logits, k, normalize, order):
    e = logits.shape[-1]
    k = min(k, e)
    inds, w = softmax_topk(mx.array(logits), k, normalize, order)
    inds, w = np.array(inds), np.array(w)
    g = _softmax(logits.astype(np.float64))
    _check_topk(g, inds, k)
    ref = np.take_along_axis(g, inds.astype(np.int64), axis=-1)
    if normalize:
        ref = ref / ref.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(w, ref, rtol=1e-4, atol=1e-6)


@SETTINGS
@given(logits=logits_st, k=st.integers(1, 8))
def test_mixtral_softmax_of_topk_logits_equals_renormalised(logits, k):
    k = min(k, logits.shape[-1])
    inds, w = softmax_topk(mx.array(logits), k, order="first", on_logits=True)
    inds, w = np.array(inds), np.array(w)
    g = _softmax(logits.astype(np.float64))
    _check_topk(g, inds, k)
    ref = np.take_along_axis(g, inds.astype(np.int64), axis=-1)
    np.testing.assert_allclose(w, ref / ref.sum(axis=-1, keepdims=True), rtol=1e-4, atol=1e-6)


def _group_reference(logits, bias, k, n_group, topk_group, scale, normalize):
    """float64 sigmoid-group: returns (masked biased selection scores, unbiased scores, kept)."""
    s = _sigmoid(logits.astype(np.float64))
    biased = s + (0 if bias is None else bias.astype(np.float64))
    grouped = biased.reshape(*biased.shape[:-1], n_group, -1)
    gscore = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # sum of each group's top-2
    order = np.argsort(-gscore, axis=-1)
    kept = order[..., :topk_group]
    mask = np.zeros_like(gscore, dtype=bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    masked = np.where(mask[..., None], grouped, 0.0).reshape(biased.shape)
    return masked, s, gscore


@SETTINGS
@given(
    data=st.data(),
    t=st.integers(1, 4),
    n_group=st.sampled_from([1, 2, 4, 8]),
    group_size=st.sampled_from([4, 8]),
    scale=st.sampled_from([1.0, 2.5]),
    normalize=st.booleans(),
    with_bias=st.booleans(),
)
def test_sigmoid_group_matches_reference(data, t, n_group, group_size, scale, normalize,
                                         with_bias):
    e = n_group * group_size
    topk_group = data.draw(st.integers(1, n_group))
    k = data.draw(st.integers(1, min(8, topk_group * group_size)))
    el = st.floats(-6, 6, width=32, allow_subnormal=False)
    logits = data.draw(arrays(np.float32, (t, e), elements=el))
    bias = data.draw(arrays(np.float32, (e,), elements=st.floats(-0.25, 0.25, width=32))) \
        if with_bias else None
    masked, s, gscore = _group_reference(logits, bias, k, n_group, topk_group, scale, normalize)
    if n_group > topk_group:  # a tie at the group boundary may legally go either way
        srt = np.sort(gscore, axis=-1)[..., ::-1]
        assume(np.all(srt[..., topk_group - 1] - srt[..., topk_group] > 1e-4))
    inds, w = sigmoid_group(mx.array(logits), k, n_group, topk_group, scale, normalize,
                            None if bias is None else mx.array(bias))
    inds, w = np.array(inds), np.array(w)
    _check_topk(masked, inds, k)
    ref = np.take_along_axis(s, inds.astype(np.int64), axis=-1)  # weights use unbiased scores
    if normalize and k > 1:
        ref = ref / (ref.sum(axis=-1, keepdims=True) + 1e-20)
    np.testing.assert_allclose(w, scale * ref, rtol=1e-4, atol=1e-6)


def test_softmax_topk_hand_worked():
    # softmax of log(1..4) is (1, 2, 3, 4) / 10; top-2 = experts 3, 2.
    logits = mx.array([[math.log(1), math.log(2), math.log(3), math.log(4)]])
    inds, w = softmax_topk(logits, 2, normalize=False)
    got = dict(zip(np.array(inds)[0].tolist(), np.array(w)[0].tolist(), strict=True))
    assert got.keys() == {2, 3}
    assert got[3] == pytest.approx(0.4) and got[2] == pytest.approx(0.3)
    inds, w = softmax_topk(logits, 2, normalize=True)
    got = dict(zip(np.array(inds)[0].tolist(), np.array(w)[0].tolist(), strict=True))
    assert got[3] == pytest.approx(4 / 7) and got[2] == pytest.approx(3 / 7)


def test_sigmoid_group_hand_worked():
    # 2 groups of 3. sigmoid(0) = .5. Group A = experts 0-2, group B = 3-5.
    # scores A: (.5, sigmoid(2), sigmoid(-2)) -> top-2 sum .5 + .881 = 1.381
    # scores B: (sigmoid(1), sigmoid(1.5), sigmoid(-3)) -> .731 + .818 = 1.549 -> B kept.
    logits = mx.array([[0.0, 2.0, -2.0, 1.0, 1.5, -3.0]])
    inds, w = sigmoid_group(logits, 2, n_group=2, topk_group=1, scale=2.0)
    got = dict(zip(np.array(inds)[0].tolist(), np.array(w)[0].tolist(), strict=True))
    s3, s4 = 1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(-1.5))
    assert got.keys() == {3, 4}  # expert 1 has the best score but its group lost
    assert got[3] == pytest.approx(2 * s3 / (s3 + s4))
    assert got[4] == pytest.approx(2 * s4 / (s3 + s4))
    # A bias of +1 on expert 0 lifts group A (1.5 + .881) and selects expert 0, but the weight
    # stays computed from the unbiased score .5.
    bias = mx.array([1.0, 0, 0, 0, 0, 0])
    inds, w = sigmoid_group(logits, 2, n_group=2, topk_group=1, scale=1.0, bias=bias)
    got = dict(zip(np.array(inds)[0].tolist(), np.array(w)[0].tolist(), strict=True))
    s1 = 1 / (1 + math.exp(-2.0))
    assert got.keys() == {0, 1}
    assert got[0] == pytest.approx(0.5 / (0.5 + s1))


def test_matches_mlx_lm_group_expert_select_bitwise():
    from mlx_lm.models.bailing_moe import group_expert_select

    cfg = small_config("bailing_moe")
    spec = routing_spec(cfg)
    key = mx.random.key(3)
    logits = mx.random.normal((2, 7, cfg["num_experts"]), key=key)
    bias = 0.05 * mx.random.normal((cfg["num_experts"],), key=mx.random.key(4))
    inds, w = route(spec, logits, bias)
    ref_inds, ref_w = group_expert_select(logits, bias, spec.top_k, spec.n_group,
                                          spec.topk_group, spec.scale, spec.normalize,
                                          spec.score_function)
    assert np.array_equal(np.array(inds), np.array(ref_inds))
    assert np.array_equal(np.array(w), np.array(ref_w))


@pytest.mark.parametrize("arch", tuple(ARCHS))
def test_routing_spec_per_arch(arch):
    spec = routing_spec(small_config(arch))
    assert spec.top_k == small_config(arch)["num_experts_per_tok"]
    grouped = ("bailing_moe", "deepseek_v3", "glm4_moe", "glm_moe_dsa")
    assert spec.rule == ("sigmoid_group" if arch in grouped else "softmax_topk")
    assert isinstance(spec, RoutingSpec)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "glm_moe_dsa"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_matches_the_deepseek_family_gate_bitwise(arch, dtype):
    """mlx-lm's own (compiled) group_expert_select of each architecture: ids in the same order
    and weights bit for bit, float32 weights from bf16 logits included."""
    from importlib import import_module

    module = import_module(f"mlx_lm.models.{'deepseek_v32' if arch == 'glm_moe_dsa' else arch}")
    cfg = small_config(arch)
    spec = routing_spec(cfg)
    e = cfg["n_routed_experts"]
    logits = mx.random.normal((2, 7, e), key=mx.random.key(3)).astype(dtype)
    bias = 0.05 * mx.random.normal((e,), key=mx.random.key(4))
    inds, w = route(spec, logits, bias)
    ref_inds, ref_w = module.group_expert_select(logits, bias, spec.top_k, spec.n_group,
                                                 spec.topk_group, spec.scale, spec.normalize)
    assert w.dtype == ref_w.dtype == mx.float32
    assert np.array_equal(np.array(inds), np.array(ref_inds))
    assert np.array_equal(np.array(w), np.array(ref_w))


def test_matches_gpt_oss_router_bitwise():
    """gpt_oss: softmax over the top-k logits, in mlx_topk's order."""
    from mlx_lm.models.gpt_oss import mlx_topk

    spec = routing_spec(small_config("gpt_oss"))
    logits = mx.random.normal((2, 7, 8), key=mx.random.key(5))
    inds, w = route(spec, logits)
    values, ref_inds = mlx_topk(logits, k=spec.top_k, axis=-1)
    assert np.array_equal(np.array(inds), np.array(ref_inds))
    assert np.array_equal(np.array(w), np.array(mx.softmax(values, axis=-1, precise=True)))
