"""Routing math, the single source for the engine and training.

Two rules (edge0 paper digest, "Routing math"):
  softmax-topk:  g = softmax(logits); inds = top-k(g); w = g[inds] (/ sum(g[inds]) when normalised)
  sigmoid-group: s = sigmoid(logits); group score = sum of each group's top-2 (of s + bias);
                 keep the top `topk_group` groups (the others are set to 0, as mlx-lm does);
                 inds = top-k of the kept (biased) scores;
                 w = scale * s[inds] / (sum(s[inds]) + eps)   (unbiased s: the bias only selects)
                 (bailing: eps 1e-20, weights cast back to the logits dtype; the deepseek
                 family: eps 0, weights stay float32)

The op sequences copy mlx-lm's MoE blocks so that the same logits give the same indices in the
same order and the same weights, bit for bit. Index ORDER matters for exact agreement: the
weighted sum over the k axis is a float reduction. mlx-lm has two orders:
  "last":  argpartition(g, kth=-k)[..., -k:]     (qwen3_moe, qwen3_next, bailing_moe, gpt_oss)
  "first": argpartition(-g, kth=k-1)[..., :k]     (mixtral, olmoe, the deepseek family)
Mixtral takes the top-k of the raw logits and softmaxes those k values; that equals the
renormalised softmax-topk mathematically (`softmax_topk(..., on_logits=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class RoutingSpec:
    """Everything a layer's routing needs besides the logits (and the optional expert bias)."""

    rule: str  # "softmax_topk" | "sigmoid_group"
    top_k: int
    normalize: bool = True
    order: str = "last"  # "last" | "first", see module docstring
    on_logits: bool = False  # mixtral: top-k on logits, softmax over the k selected
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0
    score_function: str = "sigmoid"  # sigmoid_group: "sigmoid" | "softmax" (mlx-lm allows both)
    eps: float = 1e-20  # sigmoid_group: added to the normalising sum (0: none)
    cast_weights: bool = True  # sigmoid_group: weights back to the logits dtype


def _topk_indices(scores: mx.array, k: int, order: str) -> mx.array:
    if order == "last":
        return mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]
    if order == "first":
        return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    raise ValueError(f"unknown top-k order {order!r}")


def softmax_topk(
    logits: mx.array,
    k: int,
    normalize: bool = True,
    order: str = "last",
    on_logits: bool = False,
) -> tuple[mx.array, mx.array]:
    """Returns (inds [..., k] uint32, weights [..., k] in the softmax dtype)."""
    if on_logits:
        inds = mx.stop_gradient(_topk_indices(logits, k, order))
        scores = mx.take_along_axis(logits, inds, axis=-1)
        return inds, mx.softmax(scores, axis=-1, precise=True)
    gates = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.stop_gradient(_topk_indices(gates, k, order))
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if normalize:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def sigmoid_group(
    logits: mx.array,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
    normalize: bool = True,
    bias: mx.array | None = None,
    score_function: str = "sigmoid",
    order: str = "last",
    eps: float = 1e-20,
    cast_weights: bool = True,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's `group_expert_select` (bailing_moe; with order "first", eps 0 and no cast, the
    deepseek family's), uncompiled. Scores are computed in float32. Returns (inds [..., k],
    weights [..., k])."""
    in_type = logits.dtype
    if score_function == "sigmoid":
        scores = mx.sigmoid(logits.astype(mx.float32))
    elif score_function == "softmax":
        scores = mx.softmax(logits.astype(mx.float32), axis=-1)
    else:
        raise ValueError(f"unknown score function {score_function!r}")
    orig_scores = scores
    if bias is not None:
        scores = scores + bias
    if n_group > 1:
        scores = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=drop - 1, axis=-2)[..., :drop, :]
        scores = mx.put_along_axis(
            scores, mx.stop_gradient(group_idx), mx.array(0.0, scores.dtype), axis=-2
        )
        scores = mx.flatten(scores, -2, -1)
    inds = mx.stop_gradient(_topk_indices(scores, k, order))
    weights = mx.take_along_axis(orig_scores, inds, axis=-1)
    if k > 1 and normalize:
        total = weights.sum(axis=-1, keepdims=True)
        weights = weights / (total + eps if eps else total)
    weights = weights * scale
    return inds, weights.astype(in_type) if cast_weights else weights


def route(
    spec: RoutingSpec, logits: mx.array, bias: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Apply `spec` to router logits [..., E]. `bias` only for sigmoid_group."""
    if spec.rule == "softmax_topk":
        return softmax_topk(logits, spec.top_k, spec.normalize, spec.order, spec.on_logits)
    if spec.rule == "sigmoid_group":
        return sigmoid_group(
            logits, spec.top_k, spec.n_group, spec.topk_group, spec.scale, spec.normalize,
            bias, spec.score_function, spec.order, spec.eps, spec.cast_weights,
        )
    raise ValueError(f"unknown routing rule {spec.rule!r}")
