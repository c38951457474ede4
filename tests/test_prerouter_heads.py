"""The prerouter's heads (engine.prerouter, engine.train.heads): the head's math against the
paper's concatenated one-hot form in float64 numpy, the warm start as the next router, stacked
heads equal to each head, training that improves on the warm start, the CLI that trains then
generates, and bad input."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from prerouter_helpers import _heads, _np_head, _spec

from contract.engine_config import EngineConfig
from contract.errors import BadInput
from engine.loader import load_resident, load_streaming
from engine.manifest import read_manifest
from engine.prerouter import Prerouter, PrerouterHead, PrerouterSpec, owners_for
from engine.train.heads import HeadsConfig, train_heads


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
    tokens = json.loads(r.stdout)["tokens"]
    assert len(tokens) == 4
    # the first layer's token table comes with the heads; `train hint` refits it alone
    hint = meta["report"]["first_layer_hint"]
    assert 0 <= hint["heldout_recall"] <= 1 and hint["train_rows"] > 0
    (root / "prerouter" / "first_layer_hint.npy").unlink()
    r = ssdmoe("train", "hint", str(root), "--text", str(text), "--train-windows", "4",
               "--eval-windows", "2")
    assert r.returncode == 0 and "held-out recall" in r.stdout, r.stderr
    r = ssdmoe("generate", str(root), "--prompt", "the quick", "--max-tokens", "4", "--preset",
               "staged", "--prerouter", str(root / "prerouter"), "--first-layer-hint", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == tokens  # a hint never routes
    r = ssdmoe("train", "hint", str(root), "--eval-windows", "0")
    assert r.returncode == 2 and "--eval-windows: must be >= 1" in r.stderr
    shutil.copytree(root / "prerouter", tmp_path / "bad")
    (tmp_path / "bad" / "prerouter.json").write_text("[]")  # a description that is not one
    r = ssdmoe("train", "hint", str(root), "--prerouter", str(tmp_path / "bad"))
    assert r.returncode == 2 and "not a prerouter description" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = ssdmoe("train", "hint", str(root), "--prerouter", str(tmp_path / "none"))
    assert r.returncode == 2 and "prerouter.json: no such file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


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
