"""Shared by the prerouter tests: the head's math in float64 numpy (the paper's concatenated
one-hot form), a small spec for a model, and warm-started heads perturbed away from the next
router."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.loader import load_streaming, streaming_blocks
from engine.manifest import read_manifest
from engine.prerouter import Prerouter, PrerouterHead, PrerouterSpec, owners_for, router_weight

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


def _hint_table(root: Path, path: Path) -> np.ndarray:
    """A hand-made first-layer hint table (engine.first_layer_hint) saved into `path`: token
    v -> experts (v, v + 1, ...) mod E."""
    from engine.first_layer_hint import FirstLayerHint

    m = read_manifest(root)
    vocab, e, k = m.config["vocab_size"], m.num_experts, m.top_k
    table = (np.arange(vocab)[:, None] + np.arange(k)[None, :]) % e
    FirstLayerHint(table.astype(np.int16)).save(path)
    return table
