"""Routing-structure statistics of one layer's expert choices (numpy only, never MLX).

`topk` is an int array [tokens, K] of the expert ids each token was routed to, in token order;
each row is a set (no repeated ids), as top-k routing produces."""

from __future__ import annotations

import numpy as np


def adjacent_overlap(topk: np.ndarray) -> float:
    """Mean over t >= 1 of |S_t & S_{t-1}| / K: how much of a token's expert set the next token
    reuses. NaN when there are fewer than two tokens."""
    topk = np.asarray(topk)
    if topk.ndim != 2:
        raise ValueError(f"topk must be [tokens, K], got shape {topk.shape}")
    tokens, k = topk.shape
    if tokens < 2 or k == 0:
        return float("nan")
    # shared[t, i] is True when expert topk[t+1, i] is also in row t.
    shared = (topk[1:, :, None] == topk[:-1, None, :]).any(axis=-1)
    return float(shared.sum(axis=-1).mean() / k)


def load_entropy(topk: np.ndarray, n_experts: int) -> float:
    """Entropy of the expert-load histogram divided by log(n_experts): 1.0 means every expert
    got the same number of tokens, 0.0 means one expert got them all. NaN when empty."""
    ids = np.asarray(topk).reshape(-1)
    if ids.size == 0:
        return float("nan")
    if n_experts < 2:
        return 1.0
    counts = np.bincount(ids, minlength=n_experts).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum() / np.log(n_experts))


def chance_overlap(k: int, n_experts: int) -> float:
    """Expected adjacent overlap when each token's set is an independent uniform K-subset."""
    return k / n_experts
