"""Checkpoints as users stream them: already quantized by mlx-lm (affine at other bits and group
sizes, mxfp4), in bfloat16, and sharded with an index. Each converts as it is, and the engine's
tokens equal mlx-lm's own model loaded from the same source directory."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from dequant_reference import read_tensors, swiglu_reference
from layer_reference import stacked_reference
from safetensors.numpy import load_file

from contract.engine_config import EngineConfig
from contract.errors import BadInput
from engine.convert import convert
from engine.fixtures.random_models import build_random
from engine.generate import generate
from engine.loader import load_streaming
from engine.paths.exact import ExactPath
from engine.store import ExpertStore

PROMPT = "Stream the checkpoint you chose: def f(x):"


@pytest.fixture(scope="module")
def mlx_lm_checkpoint(tmp_path_factory):
    """mlx_lm_checkpoint(arch, **mlx_lm.convert options) -> an mlx-lm directory made by
    mlx-lm's own converter from a random float32 model (cached per module)."""
    from mlx_lm.convert import convert as mlx_convert

    made: dict = {}

    def get(arch: str, **options) -> Path:
        key = (arch, tuple(sorted(options.items())))
        if key not in made:
            root = tmp_path_factory.mktemp(arch)
            src = build_random(arch, root / "float", seed=1)
            mlx_convert(str(src), str(root / "mlx"), **options)
            made[key] = root / "mlx"
        return made[key]

    return get


def _mlx_lm_tokens(src: Path, n: int = 16) -> list[int]:
    """Sampled decode of mlx-lm's own model loaded from `src` (temperature 1, seed 11)."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(str(src))
    mx.random.seed(11)
    out = [int(t) for t, _ in generate_step(mx.array(tok.encode(PROMPT)), model, max_tokens=n,
                                             sampler=make_sampler(1.0))]
    assert len(set(out)) > 3, f"the reference collapsed ({out})"
    return out


def _engine_tokens(dst: Path, preset: str, n: int = 16, **config) -> list[int]:
    eng = load_streaming(dst, config=EngineConfig.from_preset(preset, **config))
    model, tok = eng.model, eng.tokenizer
    try:
        return generate(model, tok, PROMPT, n, temp=1.0, seed=11, stop_at_eos=False,
                        runtime=eng.runtime).tokens
    finally:
        eng.close()


def _expert_source(src: Path, layer: int, attr: str = "switch_mlp") -> dict[str, np.ndarray]:
    """The stacked expert tensors of `layer` in an mlx-lm directory, by stored name."""
    out = {}
    for f in sorted(src.glob("model*.safetensors")):
        prefix = f"model.layers.{layer}.mlp.{attr}."
        out.update({k[len(prefix):]: v for k, v in load_file(str(f)).items()
                    if k.startswith(prefix)})
    return out


@pytest.mark.parametrize("arch,options,attr", [
    ("gpt_oss", {"q_mode": "mxfp4", "q_group_size": 32, "q_bits": 4}, "experts"),
    ("qwen3_moe", {"q_bits": 8, "q_group_size": 32}, "switch_mlp"),
])
def test_quantized_checkpoint_keeps_its_quantization(arch, options, attr, mlx_lm_checkpoint,
                                                     tmp_path):
    src = mlx_lm_checkpoint(arch, quantize=True, **options)
    m = convert(src, tmp_path / "stream")
    mode = options.get("q_mode", "affine")
    assert m.quantization["mode"] == mode and m.quantization["bits"] == options["q_bits"]
    assert m.quantization["group_size"] == options["q_group_size"]
    assert m.quantization["requantized"] is False
    layer = m.moe_layers[0]
    stored = stacked_reference(tmp_path / "stream" / m.layers[layer].file)
    source = _expert_source(src, layer, attr)
    assert set(stored) == set(source)
    for name, v in source.items():  # bytes as the checkpoint has them (f32 scales here)
        assert np.array_equal(stored[name], v.astype(stored[name].dtype)), name
    if mode == "mxfp4":
        assert stored["gate_proj.scales"].dtype == np.uint8 and "gate_proj.biases" not in stored

    # The float64 reference of the checkpoint's own mode, on the exact path.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, m.config["hidden_size"])).astype(np.float32)
    inds = np.stack([rng.choice(m.num_experts, m.top_k, replace=False) for _ in range(3)])
    with ExpertStore(m) as store:
        y = np.array(ExactPath(store, layer)(mx.array(x), mx.array(inds.astype(np.uint32))),
                     dtype=np.float64)
    ref = swiglu_reference(x, inds, stored, options["q_group_size"], options["q_bits"], mode,
                           "swiglu_oai" if arch == "gpt_oss" else "swiglu")
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.01

    want = _mlx_lm_tokens(src)
    for preset in ("on-demand", "staged"):
        assert _engine_tokens(tmp_path / "stream", preset) == want, preset


def test_requantize_is_asked_for_and_recorded(mlx_lm_checkpoint, tmp_path):
    src = mlx_lm_checkpoint("gpt_oss", quantize=True, q_mode="mxfp4", q_group_size=32,
                            q_bits=4)
    with pytest.raises(BadInput, match=r"already quantized \(mxfp4, 4-bit, group 32\)"):
        convert(src, tmp_path / "refused", group_size=64)
    m = convert(src, tmp_path / "affine", requantize=True)
    assert m.quantization == {"bits": 4, "group_size": 64, "mode": "affine",
                              "scales_dtype": "float32", "requantized": True}
    assert "gate_proj.biases" in m.layers[m.moe_layers[0]].tensors


def test_a_mode_the_kernels_cannot_run_is_one_line(tmp_path):
    src = build_random("qwen3_moe", tmp_path / "float", seed=1)
    with pytest.raises(BadInput, match=r"affine 7-bit group 64: MLX's kernels cannot run"):
        convert(src, tmp_path / "out", bits=7)


def test_cli_convert_keeps_or_requantizes(mlx_lm_checkpoint, tmp_path, ssdmoe):
    src = mlx_lm_checkpoint("gpt_oss", quantize=True, q_mode="mxfp4", q_group_size=32,
                            q_bits=4)
    r = ssdmoe("convert", str(src), str(tmp_path / "kept"))
    assert r.returncode == 0, r.stderr
    assert "mxfp4 4-bit group 32, as the checkpoint has them" in r.stdout
    assert "layer 1: experts (2/2)" in r.stderr  # progress, a line per layer
    r = ssdmoe("convert", str(src), str(tmp_path / "g64"), "--group-size", "64")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--requantize" in r.stderr and not (tmp_path / "g64").exists()
    r = ssdmoe("convert", str(src), str(tmp_path / "redone"), "--requantize")
    assert r.returncode == 0 and "affine 4-bit group 64, requantized" in r.stdout, r.stderr
    r = ssdmoe("convert", str(src), str(tmp_path / "bad"), "--dtype", "float16")
    assert r.returncode == 2 and "--dtype 'float16': unknown" in r.stderr


@pytest.mark.skipif(__import__("engine.device", fromlist=["gpu_name"]).gpu_name() is not None,
                    reason="this machine has a GPU backend")
def test_device_gpu_without_a_gpu_backend_is_one_line(tiny_random_converted, ssdmoe):
    r = ssdmoe("--device", "gpu", "generate", str(tiny_random_converted), "--prompt", "x")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no GPU backend" in r.stderr
    r = ssdmoe("--device", "cpu", "generate", str(tiny_random_converted), "--prompt", "x",
               "--max-tokens", "2")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_bfloat16_checkpoint_in_its_own_dtype_equals_mlx_lm(arch, mlx_lm_checkpoint, tmp_path):
    """What Metal and CUDA run (engine.device): a bf16 checkpoint's scales kept bf16 and
    activations computed in bf16, here on the CPU: tokens equal mlx-lm's own bf16 model."""
    src = mlx_lm_checkpoint(arch, quantize=True, dtype="bfloat16", q_bits=4, q_group_size=64)
    m = convert(src, tmp_path / "bf16", float32=False)
    assert m.quantization["scales_dtype"] == "bfloat16"
    # bf16 arithmetic against float64. MLX's CPU kernels accumulate bf16 in bf16: one
    # gather_qmm misses float64 by 1.4% at this width (reports/device/bf16_cpu.py), so the 1%
    # contract is held on the CPU by its float32 policy, and this bound only catches a wrong
    # expert, scale or bias (each far above 5%).
    layer = m.moe_layers[0]
    stored = read_tensors(tmp_path / "bf16" / m.layers[layer].file)
    assert stored["gate_proj.scales"].dtype == np.uint16  # bf16 bits (NumPy has no bf16)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((3, m.config["hidden_size"]))).astype(mx.bfloat16)
    inds = np.stack([rng.choice(m.num_experts, m.top_k, replace=False) for _ in range(3)])
    with ExpertStore(m) as store:
        y = ExactPath(store, layer)(x, mx.array(inds.astype(np.uint32)))
        assert y.dtype == mx.bfloat16
        y = np.array(y.astype(mx.float32), dtype=np.float64)
    ref = swiglu_reference(np.array(x.astype(mx.float32)), inds, stored)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05
    assert _engine_tokens(tmp_path / "bf16", "staged", dtype="source") == _mlx_lm_tokens(src)
    # the CPU default stores and computes float32
    assert convert(src, tmp_path / "f32").quantization["scales_dtype"] == "float32"


def _shard(src: Path, out: Path, parts: int = 3) -> dict:
    """Rewrite `src`'s model.safetensors as `parts` shards and an index, the way mlx-community
    checkpoints ship (model-0000x-of-0000y.safetensors + model.safetensors.index.json)."""
    out.mkdir()
    weights = mx.load(str(src / "model.safetensors"))
    names = sorted(weights)
    weight_map = {}
    for i in range(parts):
        shard = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        part = {k: weights[k] for k in names[i::parts]}
        mx.save_safetensors(str(out / shard), part, metadata={"format": "mlx"})
        weight_map.update({k: shard for k in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_sharded_checkpoint_converts_like_one_file(mlx_lm_checkpoint, tmp_path):
    src = mlx_lm_checkpoint("qwen3_moe", quantize=True, q_bits=4, q_group_size=64)
    one = convert(src, tmp_path / "one")
    index = _shard(src, tmp_path / "sharded")
    many = convert(tmp_path / "sharded", tmp_path / "many")
    for rel in (*(e.file for e in one.layers.values()), "resident.safetensors"):
        assert many.files[rel].sha256 == one.files[rel].sha256, rel
    assert "model.safetensors.index.json" not in many.files

    # An index that disagrees with its shards: one line naming the index and the tensor.
    name = sorted(index["weight_map"])[0]
    assert index["weight_map"][name] == "model-00001-of-00003.safetensors"
    bad = tmp_path / "sharded" / "model.safetensors.index.json"
    for change, match in [
        (lambda wm: wm.update({name: "model-00002-of-00003.safetensors"}),
         rf"{name} is in model-00001-of-00003.safetensors, the index says"),
        (lambda wm: wm.update({name: "model-00009-of-00009.safetensors"}),
         "shard model-00009-of-00009.safetensors .* is missing"),
        (lambda wm: wm.pop(name), rf"{name} is not in model.safetensors.index.json"),
        (lambda wm: wm.update({"model.extra.weight": wm[name]}),
         "model.extra.weight is not in its shard"),
    ]:
        wm = dict(index["weight_map"])
        change(wm)
        bad.write_text(json.dumps({"weight_map": wm}))
        with pytest.raises(BadInput, match=match):
            convert(tmp_path / "sharded", tmp_path / "bad")
