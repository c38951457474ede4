"""convert: manifest, byte layout, numbers, source variants, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from layer_reference import stacked_reference
from safetensors.numpy import load_file

from contract.errors import BadInput
from engine.archs import ARCHS
from engine.convert import convert, export_mlx
from engine.manifest import (
    expert_tensor_names,
    read_manifest,
    sha256_file,
    verify_files,
)
from engine.safetensors_io import read_safetensors_header

ARCH_NAMES = tuple(ARCHS)


def _expert_slice(path: Path, offset: int, stride: int, shape, dtype) -> np.ndarray:
    """An expert's slice read straight from the file bytes (independent of the store)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(stride), dtype=dtype).reshape(shape)


def _source_weights(src: Path) -> dict[str, mx.array]:
    return mx.load(str(src / "model.safetensors"))


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_convert_each_arch(arch, arch_model):
    src, dst = arch_model(arch)
    m = read_manifest(dst)
    cfg = json.loads((src / "config.json").read_text())
    assert m.model_type == arch and m.num_experts == cfg[ARCHS[arch].experts_key]
    assert m.quantization == {"bits": 4, "group_size": 64, "mode": "affine",
                              "scales_dtype": "float32", "requantized": False}
    verify_files(m, full_hash=True)
    for rel, entry in m.files.items():
        assert (dst / rel).stat().st_size == entry.size
        assert sha256_file(dst / rel) == entry.sha256
    source = _source_weights(src)
    experts = f".{ARCHS[arch].moe_attr}.{ARCHS[arch].experts_attr}."
    moe_prefixes = {k.rsplit(experts, 1)[0] for k in source if experts in k}
    assert sorted(int(p.split(".")[2]) for p in moe_prefixes) == m.moe_layers

    # Resident: every non-expert tensor, bit-identical; no routed expert tensor.
    resident = mx.load(str(dst / "resident.safetensors"))
    assert set(resident) == {k for k in source if experts not in k}
    for k, v in resident.items():
        assert np.array_equal(np.array(v), np.array(source[k])), k
    if arch == "qwen3_next":
        assert any(".shared_expert_gate." in k for k in resident)
        assert any(".shared_expert.down_proj." in k for k in resident)
    if arch == "bailing_moe":
        assert any(k.endswith("gate.expert_bias") for k in resident)
    if arch in ("bailing_moe", "deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        assert any(".shared_experts." in k for k in resident)
    if arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        assert any(k.endswith("gate.e_score_correction_bias") for k in resident)
    linear_bias = arch == "gpt_oss"  # its experts add a bias after each projection

    # Experts: expert e's slice of each tensor, read from its byte range, equals mx.quantize of
    # the source float expert. The bundled layout: per expert its slices back to back in the
    # manifest's order (one contiguous range), every bundle starting 4096-aligned, a pad
    # tensor filling the gap to the next bundle when there is one.
    for layer, entry in m.layers.items():
        path = dst / entry.file
        data_start, header = read_safetensors_header(path)
        assert data_start % 4096 == 0
        want = list(expert_tensor_names(True, linear_bias))
        assert list(entry.names) == want
        assert len(want) == (12 if linear_bias else 9)
        assert entry.bundle_bytes == sum(t.nbytes for t in entry.tensors.values())
        pad = -entry.bundle_bytes % 4096
        order = [k for k in header if k != "__metadata__"]
        per_expert = want + (["pad"] if pad else [])
        assert order == [f"experts.{e}.{n}" for e in range(m.num_experts) for n in per_expert]
        for e in range(m.num_experts):
            ranges = [entry.expert_range(n, e) for n in want]
            assert ranges[0][0] % 4096 == 0, (layer, e)
            for (o0, n0), (o1, _) in zip(ranges, ranges[1:], strict=False):
                assert o0 + n0 == o1, (layer, e)  # back to back: one contiguous range
            for n, (off, length) in zip(want, ranges, strict=True):
                a, b = header[f"experts.{e}.{n}"]["data_offsets"]
                assert (data_start + a, b - a) == (off, length)
        prefix = f"model.layers.{layer}{experts}"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w = source[f"{prefix}{proj}.weight"]
            for e in (0, m.num_experts - 1):
                q, s, b = mx.quantize(w[e], 64, 4)
                parts = [("weight", q), ("scales", s), ("biases", b)]
                if linear_bias:
                    parts.append(("bias", source[f"{prefix}{proj}.bias"][e]))
                for part, ref in parts:
                    t = entry.tensors[f"{proj}.{part}"]
                    got = _expert_slice(path, t.offset + e * t.stride, t.nbytes, t.shape[1:],
                                        t.dtype)
                    assert np.array_equal(got, np.array(ref)), (layer, proj, part, e)


def test_quantized_source_is_copied_or_requantized(tiny_random_converted, tmp_path):
    # An mlx-lm quantized checkpoint (experts int4 g64) converts to byte-identical expert files.
    exported = export_mlx(tiny_random_converted, tmp_path / "q")
    again = convert(exported, tmp_path / "again")
    first = read_manifest(tiny_random_converted)
    assert again.quantization["requantized"] is False
    for layer, entry in first.layers.items():
        assert again.files[entry.file].sha256 == first.files[entry.file].sha256, layer
    # Another group size changes the model: refused unless asked for.
    with pytest.raises(BadInput, match="already quantized .affine, 4-bit, group 64.*--requantize"):
        convert(exported, tmp_path / "g32-refused", group_size=32)
    # Asked for, it is dequantized and requantized, and the manifest says so.
    g32 = convert(exported, tmp_path / "g32", group_size=32, requantize=True)
    assert g32.quantization["requantized"] is True and g32.quantization["group_size"] == 32
    layer = g32.moe_layers[0]
    src = load_file(str(exported / "model.safetensors"))
    out = stacked_reference(tmp_path / "g32" / g32.layers[layer].file)
    prefix = f"model.layers.{layer}.mlp.switch_mlp.up_proj"
    deq = mx.dequantize(mx.array(src[f"{prefix}.weight"]), mx.array(src[f"{prefix}.scales"]),
                        mx.array(src[f"{prefix}.biases"]), 64, 4)
    q, s, b = mx.quantize(deq, 32, 4)
    assert np.array_equal(out["up_proj.weight"], np.array(q))
    assert np.array_equal(out["up_proj.scales"], np.array(s))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_per_expert_source_names(arch, arch_model, tmp_path):
    """A Hugging Face style source with one tensor per expert (mixtral: w1/w2/w3) goes through
    mlx-lm's sanitize and converts to the same expert bytes as the stacked source."""
    src, dst = arch_model(arch)
    weights = dict(_source_weights(src))
    unstacked = {}
    names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"} if arch == "mixtral" \
        else {p: p for p in ("gate_proj", "up_proj", "down_proj")}
    for k, v in weights.items():
        if ".switch_mlp." not in k:
            unstacked[k] = v
            continue
        prefix, rest = k.split(".switch_mlp.")
        proj = rest.split(".")[0]
        for e in range(v.shape[0]):
            unstacked[f"{prefix}.experts.{e}.{names[proj]}.weight"] = v[e]
    hf = tmp_path / "hf"
    hf.mkdir()
    mx.save_safetensors(str(hf / "model.safetensors"), unstacked)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (hf / f.name).write_bytes(f.read_bytes())
    m = convert(hf, tmp_path / "out")
    ref = read_manifest(dst)
    for entry in ref.layers.values():
        assert m.files[entry.file].sha256 == ref.files[entry.file].sha256


def _fixture_copy(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "src"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def test_bad_sources(tiny_random_dir, tmp_path):
    with pytest.raises(BadInput, match="config.json: missing"):
        convert(tmp_path, tmp_path / "o1")

    src = _fixture_copy(tiny_random_dir, tmp_path)
    cfg = json.loads((src / "config.json").read_text())

    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(BadInput, match=r"config.json: unsupported architecture 'llama'"):
        convert(src, tmp_path / "o2")

    (src / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 192}))
    with pytest.raises(BadInput, match=r"model.safetensors: config does not match tensors"):
        convert(src, tmp_path / "o3")

    (src / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(BadInput, match=r"config does not match tensors: \d+ missing"):
        convert(src, tmp_path / "o4")

    (src / "config.json").write_text(json.dumps(cfg))
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInput, match=r"model.safetensors: truncated"):
        convert(src, tmp_path / "o5")

    (src / "model.safetensors").unlink()
    with pytest.raises(BadInput, match=r"no model\*.safetensors"):
        convert(src, tmp_path / "o6")


def test_cli_convert(tiny_random_dir, tmp_path, ssdmoe, ssdmoe_subprocess):
    r = ssdmoe_subprocess("convert", str(tiny_random_dir), str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    assert "4 MoE layers x 32 experts" in r.stdout
    verify_files(read_manifest(tmp_path / "c"), full_hash=True)
    assert not (tmp_path / "c.partial").exists()
    # Refuses to overwrite without --force; one line on stderr, exit 2.
    r = ssdmoe("convert", str(tiny_random_dir), str(tmp_path / "c"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "--force" in r.stderr

    src = _fixture_copy(tiny_random_dir, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    r = ssdmoe("convert", str(src), str(tmp_path / "c2"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.json" in lines[0] and "unsupported architecture" in lines[0]
    assert not (tmp_path / "c2").exists() and not (tmp_path / "c2.partial").exists()


@pytest.mark.parametrize("shards", [1, 4])
def test_convert_streams_tensor_by_tensor(tmp_path, shards):
    """Peak RSS of a conversion grows by far less than the checkpoint: one stacked tensor at a
    time, never the model (a 300 MB float32 checkpoint here, in one file or in shards with
    their index, as mlx-community checkpoints ship)."""
    from engine.fixtures.random_models import build_random, small_config

    cfg = small_config("qwen3_moe")
    cfg.update(num_hidden_layers=2, hidden_size=512, num_experts=64, moe_intermediate_size=384,
               num_attention_heads=8, head_dim=64)
    src = build_random("qwen3_moe", tmp_path / "src", 0, cfg)
    size = (src / "model.safetensors").stat().st_size
    assert size > 250e6
    if shards > 1:
        weights = mx.load(str(src / "model.safetensors"))
        names = sorted(weights)
        weight_map = {}
        for i in range(shards):
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            mx.save_safetensors(str(src / shard), {k: weights[k] for k in names[i::shards]})
            weight_map.update({k: shard for k in names[i::shards]})
        del weights
        (src / "model.safetensors").unlink()
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code = (  # VmHWM (not ru_maxrss, which a child inherits across exec from its parent)
        "import sys\n"
        "import mlx.core, mlx_lm.models.qwen3_moe\n"
        "from engine.convert import convert\n"
        "def hwm():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmHWM:'):\n"
        "            return int(line.split()[1]) * 1024\n"
        "base = hwm()\n"
        "convert(sys.argv[1], sys.argv[2])\n"
        "print(base, hwm())\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    base, peak = map(int, r.stdout.split())
    assert peak - base < 0.4 * size, (base, peak, size)
