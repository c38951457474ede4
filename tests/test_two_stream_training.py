"""Training on two CPU streams gives the bits of one: each product and both its gradients
bitwise against the plain mlx-lm / mlx.nn modules, and a model's weights after training steps
(engine.fixtures.two_stream_training)."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_moe
from mlx_lm.models.switch_layers import SwitchLinear

from engine.fixtures.train_loop import train
from engine.fixtures.trained import TrainedConfig, model_config
from engine.fixtures.two_stream_training import (
    split_gradients_product,
    split_rows_projection,
    two_stream_training,
)

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU streams only")


def _streams():
    return mx.default_stream(mx.cpu), mx.new_stream(mx.cpu)


def _same(a: mx.array, b: mx.array) -> bool:
    return np.array_equal(np.array(a), np.array(b))


def test_an_expert_projection_and_its_gradients_are_bitwise_mlx_lms():
    mx.random.seed(3)
    layer = SwitchLinear(96, 48, 16, bias=False)
    rows = 1000
    idx = mx.array(np.sort(np.random.default_rng(0).integers(0, 16, rows)).astype(np.uint32))
    assert idx[rows // 2 - 1].item() == idx[rows // 2].item()  # an expert straddles the halves
    x, cotangent = mx.random.normal((rows, 1, 96)), mx.random.normal((rows, 1, 48))

    def mlx_lm(x, w):
        layer.weight = w
        return layer(x, idx, sorted_indices=True)

    project = split_rows_projection(_streams())
    ref_out, ref_grads = mx.vjp(mlx_lm, [x, layer.weight], [cotangent])
    out, grads = mx.vjp(lambda x, w: project(x, w, idx), [x, layer.weight], [cotangent])
    assert _same(out[0], ref_out[0])
    assert _same(grads[0], ref_grads[0]) and _same(grads[1], ref_grads[1])  # input, weight


def test_a_dense_product_and_its_gradients_are_bitwise_mlx_nns():
    mx.random.seed(4)
    linear = nn.Linear(96, 200, bias=False)
    x, cotangent = mx.random.normal((8, 50, 96)), mx.random.normal((8, 50, 200))

    def plain(x, w):
        linear.weight = w
        return linear(x)

    product = split_gradients_product(_streams())
    ref_out, ref_grads = mx.vjp(plain, [x, linear.weight], [cotangent])
    out, grads = mx.vjp(product, [x, linear.weight], [cotangent])
    assert _same(out[0], ref_out[0])
    assert _same(grads[0], ref_grads[0]) and _same(grads[1], ref_grads[1])


def test_a_quantized_models_forward_is_bitwise_the_same():
    """As the prerouter heads record it: the converted (int4) model, frozen."""
    from engine.fixtures.train_loop import forward_with_taps

    cfg = TrainedConfig(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, experts=8,
                        top_k=2, moe_intermediate=64, vocab_size=256)
    mx.random.seed(1)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(model_config(cfg, 0)))
    nn.quantize(model, group_size=64, bits=4,
                class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    tokens = mx.array(np.random.default_rng(2).integers(0, 256, (4, 40)).astype(np.int32))
    ref, ref_taps = forward_with_taps(model, tokens)
    with two_stream_training(model) as switched:
        out, taps = forward_with_taps(model, tokens)
        mx.eval(out, taps[-1].x)
    assert switched == 2 * 3 + 2 * (4 + 1) + 1  # quantized experts; dense projections; head
    assert _same(out, ref) and all(_same(a.x, b.x) for a, b in zip(taps, ref_taps, strict=True))


def _model_after_steps(two_streams: bool) -> tuple[dict[str, np.ndarray], int]:
    cfg = TrainedConfig(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, experts=8,
                        top_k=2, moe_intermediate=32, vocab_size=256, seq_len=32, batch=4)
    mx.random.seed(0)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(model_config(cfg, 0)))
    mx.eval(model.parameters())
    data = np.random.default_rng(0).integers(0, cfg.vocab_size,
                                             (3, cfg.batch, cfg.seq_len + 1)).astype(np.int32)
    kinds = {name: type(m) for name, m in model.named_modules()}

    optimizer = optim.AdamW(learning_rate=1e-2, weight_decay=0.1)

    def steps():
        train(model, optimizer, lambda i: (data[i, :, :-1], data[i, :, 1:]), 3, 0.1,
              progress=False, compile_step=False)

    switched = 0
    if two_streams:
        with two_stream_training(model, optimizer) as switched:
            steps()
        assert {name: type(m) for name, m in model.named_modules()} == kinds  # restored
        assert not any(hasattr(m, "two_stream") for _, m in model.named_modules())
        assert type(optimizer) is optim.AdamW
    else:
        steps()
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}, switched


def test_training_steps_give_the_same_weights():
    one, _ = _model_after_steps(False)
    two, switched = _model_after_steps(True)
    # per layer: gate, up, down; q, k, v, o; the router; and the tied embedding's head
    assert switched == 2 * (3 + 4 + 1) + 1
    assert one.keys() == two.keys()
    assert all(np.array_equal(one[k], two[k]) for k in one)
