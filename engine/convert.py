"""`convert`: an mlx-lm MoE checkpoint -> the streaming layout (see engine/manifest.py).

Decisions:
- Routed experts keep the checkpoint's own quantization, or are quantized the mlx-lm way from
  a float checkpoint (engine.expert_quant), one file per MoE layer.
- The resident part (attention, embeddings, norms, routers, shared experts, dense MLPs) is
  copied as it is in the source, float or quantized, under its mlx-lm (post-sanitize) names.
  The loader upcasts float tensors to float32 on CPU; requantizing them is not this module's job.
- Streaming: the source is opened with `mx.load` (lazy: a tensor is read when evaluated), one
  shard or many (`model-0000x-of-0000y.safetensors` with its index, checked against the
  shards), each output tensor is evaluated, written and dropped in turn, and safetensors
  headers are computed up front from the lazy shapes, so peak memory is about one layer's
  experts (the bundled layout interleaves a layer's tensors), never the model.
- The layer files are bundled (one contiguous, aligned range per expert: one vectored read
  loads it) unless `layout="stacked"` asks for the version-1 layout (engine.manifest).
- Each written safetensors file has its data section starting at a 4096-byte boundary (the
  header is padded with spaces, which the format allows), for O_DIRECT whole-tensor reads.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from importlib import import_module
from pathlib import Path

from contract.errors import BadInput, read_json_object
from contract.thresholds import ALIGN
from engine import expert_quant
from engine.archs import ARCHS, arch_for
from engine.layer_file import stacked_experts
from engine.manifest import (
    CONFIG_FILE,
    EXPERTS_DIR,
    LAYOUTS,
    MANIFEST_FILE,
    RESIDENT_FILE,
    FileEntry,
    LayerEntry,
    Manifest,
    TensorEntry,
    bundle_checksums,
    read_manifest,
    verify_files,
    write_manifest,
)
from engine.safetensors_io import dtype_name, nbytes_of, read_safetensors_header, write_safetensors

QUANT_KEYS = ("quantization", "quantization_config")
INDEX_FILE = "model.safetensors.index.json"
Progress = Callable[[str], None]


# ---------------------------------------------------------------- source checkpoint


def read_config(path: Path) -> dict:
    cfg = read_json_object(path)
    if "model_type" not in cfg:
        raise BadInput(f"{path}: no model_type")
    if arch_for(cfg["model_type"]) is None:
        raise BadInput(f"{path}: unsupported architecture {cfg['model_type']!r} "
                       f"(supported: {', '.join(ARCHS)})")
    return cfg


def build_skeleton(cfg: dict, cfg_path: Path):
    """mlx-lm's Model for `cfg`, with lazy (never evaluated) random weights."""
    try:
        module = import_module(f"mlx_lm.models.{cfg['model_type']}")
        return module.Model(module.ModelArgs.from_dict(cfg))
    except Exception as err:  # noqa: BLE001 - any constructor failure is a config problem
        raise BadInput(f"{cfg_path}: cannot build a {cfg['model_type']} model "
                       f"({type(err).__name__}: {err})") from None


def moe_layers(model, model_type: str) -> dict[int, str]:
    """{layer index: parameter prefix of its SwitchGLU} for the layers that route experts."""
    arch = ARCHS[model_type]
    out = {}
    for i, layer in enumerate(model.layers):
        block = getattr(layer, arch.moe_attr, None)
        if block is not None and hasattr(block, arch.experts_attr):
            out[i] = f"model.layers.{i}.{arch.moe_attr}.{arch.experts_attr}"
    return out


def switch_glu_of(model, model_type: str, layer: int):
    """The mlx-lm SwitchGLU holding layer `layer`'s routed experts."""
    arch = ARCHS[model_type]
    return getattr(getattr(model.layers[layer], arch.moe_attr), arch.experts_attr)


def quantize_like_source(model, qcfg: dict, weights: dict) -> None:
    """mlx-lm's load-time quantization: quantize the modules the checkpoint has scales for."""
    import mlx.nn as nn
    from mlx_lm.utils import infer_quant_config

    def predicate(p, m):
        if p in qcfg:
            return qcfg[p]
        if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
            return False
        return infer_quant_config(p, m, weights)

    nn.quantize(model, group_size=qcfg.get("group_size", 64), bits=qcfg.get("bits", 4),
                mode=qcfg.get("mode", "affine"), class_predicate=predicate)


def _source_quantization(cfg: dict, cfg_path: Path) -> dict | None:
    q = cfg.get("quantization")
    if q is None and cfg.get("quantization_config") is not None:
        raise BadInput(f"{cfg_path}: quantization_config without mlx-lm `quantization` "
                       "(convert it with mlx_lm.convert first)")
    return q


def _load_source(src: Path) -> tuple[dict, dict[str, Path]]:
    """(lazy tensors, tensor -> its shard) of every model*.safetensors shard of `src`, checked
    against the shard index when there is one."""
    import mlx.core as mx

    files = sorted(src.glob("model*.safetensors"))
    if not files:
        raise BadInput(f"{src}: no model*.safetensors files")
    weights, where = {}, {}
    for wf in files:
        read_safetensors_header(wf)
        try:
            loaded = mx.load(str(wf))
        except Exception as err:  # noqa: BLE001
            raise BadInput(f"{wf}: cannot read ({err})") from None
        weights.update(loaded)
        where.update({k: wf for k in loaded})
    if (src / INDEX_FILE).is_file():
        _check_index(src / INDEX_FILE, where)
    return weights, where


def _check_index(index: Path, where: dict[str, Path]) -> None:
    """The shard index (mlx-lm and Hugging Face's weight_map) must name, for every tensor, the
    shard that holds it, and list every tensor the shards hold."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise BadInput(f"{index}: no weight_map")
    for name, shard in sorted(weight_map.items()):
        if not (index.parent / str(shard)).is_file():
            raise BadInput(f"{index}: shard {shard} (of {name}) is missing")
        if name not in where:
            raise BadInput(f"{index}: {name} is not in its shard {shard}")
        if where[name].name != shard:
            raise BadInput(f"{index}: {name} is in {where[name].name}, the index says {shard}")
    extra = sorted(set(where) - set(weight_map))
    if extra:
        raise BadInput(f"{where[extra[0]]}: {extra[0]} is not in {index.name}"
                       + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))


def _check_tensors(expected: dict, weights: dict, where: dict, src: Path) -> None:
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise BadInput(f"{src}: config does not match tensors: {len(missing)} missing, "
                       f"e.g. {missing[0]}")
    if extra:
        f = where.get(extra[0], src)
        raise BadInput(f"{f}: config does not match tensors: unexpected tensor {extra[0]}"
                       + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise BadInput(f"{where.get(k, src)}: config does not match tensors: {k} has shape "
                           f"{tuple(weights[k].shape)}, config gives {tuple(v.shape)}")


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer and generation files: every top-level regular file but weights and config."""
    skip = {CONFIG_FILE, MANIFEST_FILE, "model.safetensors.index.json"}
    copied = []
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in skip:
            shutil.copyfile(p, dst / p.name)
            copied.append(p.name)
    return copied

# ---------------------------------------------------------------- convert


def convert(src: Path, dst: Path, bits: int | None = None, group_size: int | None = None,
            requantize: bool = False, float32: bool | None = None,
            progress: Progress | None = None, layout: str = "bundled") -> Manifest:
    """Convert the mlx-lm MoE checkpoint directory `src` into the streaming layout at `dst`.
    `bits` / `group_size`: of a float checkpoint's experts (default 4 / 64), or of a quantized
    one's with `requantize`. `float32`: write float scales and biases as float32 (None: when
    MLX runs on its CPU backend, engine.device). `layout`: "bundled" (one contiguous range
    per expert) or "stacked" (the version-1 layout, one tensor per name: engine.manifest)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.device import upcasts

    src, dst = Path(src), Path(dst)
    say = progress or (lambda _msg: None)
    if layout not in LAYOUTS:
        raise BadInput(f"convert: layout {layout!r} unknown (one of: {', '.join(LAYOUTS)})")
    if not src.is_dir():
        raise BadInput(f"{src}: not a directory")
    cfg_path = src / CONFIG_FILE
    cfg = read_config(cfg_path)
    mt = cfg["model_type"]
    src_q = _source_quantization(cfg, cfg_path)
    model = build_skeleton(cfg, cfg_path)
    weights, where = _load_source(src)
    try:
        weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    except Exception as err:  # noqa: BLE001
        raise BadInput(f"{src}: config does not match tensors ({type(err).__name__}: {err})") \
            from None
    if src_q is not None:
        quantize_like_source(model, src_q, weights)
    expected = dict(tree_flatten(model.parameters()))
    _check_tensors(expected, weights, where, src)
    layers = moe_layers(model, mt)
    if not layers:
        raise BadInput(f"{cfg_path}: no MoE layers in this config")
    first = min(layers)
    quant = expert_quant.plan(
        switch_glu_of(model, mt, first).gate_proj, bits, group_size, requantize,
        upcasts() if float32 is None else float32, where.get(f"{layers[first]}.gate_proj.weight",
                                                              src))
    for i in layers:
        for p in ("gate_proj", "up_proj", "down_proj"):
            in_dim = getattr(switch_glu_of(model, mt, i), p).input_dims
            if in_dim % quant.group_size:
                raise BadInput(f"{cfg_path}: {p} input size {in_dim} is not a multiple of the "
                               f"experts' group size {quant.group_size}")

    dst.mkdir(parents=True, exist_ok=True)
    (dst / EXPERTS_DIR).mkdir(exist_ok=True)
    (dst / MANIFEST_FILE).unlink(missing_ok=True)  # an interrupted run leaves no manifest
    files: dict[str, FileEntry] = {}

    # Resident part.
    routed = {k for p in layers.values() for k in expected if k.startswith(p + ".")}
    resident_names = sorted(k for k in expected if k not in routed)
    specs = [(k, tuple(weights[k].shape), dtype_name(weights[k].dtype)) for k in resident_names]
    say(f"resident: {len(specs)} tensors")
    files[RESIDENT_FILE], _ = write_safetensors(
        dst / RESIDENT_FILE, specs, lambda k: _evaluated(weights.pop(k), where.get(k, src), k))

    # Routed experts, one file per MoE layer.
    entries, scales_dtype = {}, None
    num_experts = int(cfg[ARCHS[mt].experts_key])
    for n, i in enumerate(sorted(layers), 1):
        say(f"layer {i}: experts ({n}/{len(layers)})")
        rel = f"{EXPERTS_DIR}/layer_{i:03d}.safetensors"
        shard = where.get(f"{layers[i]}.gate_proj.weight", src)
        tensors = expert_quant.layer_tensors(weights, layers[i], switch_glu_of(model, mt, i),
                                             quant)
        scales_dtype = dtype_name(tensors["gate_proj.scales"].dtype)
        stacked = {k: (tuple(v.shape), dtype_name(v.dtype)) for k, v in tensors.items()}
        if layout == "stacked":
            specs = [(k, shape, dt) for k, (shape, dt) in stacked.items()]
            files[rel], offsets = write_safetensors(
                dst / rel, specs, lambda k, t=tensors, f=shard: _evaluated(t.pop(k), f, k))
            entry = {k: TensorEntry(offsets[k], nbytes_of(shape[1:], dt), list(shape), dt,
                                    nbytes_of(shape[1:], dt))
                     for k, (shape, dt) in stacked.items()}
        else:
            for k in list(tensors):  # the layer's experts in memory at once: a file per layer
                tensors[k] = _evaluated(tensors[k], shard, k)
            specs, pad = bundled_specs(stacked), bundle_pad(stacked)
            files[rel], offsets = write_safetensors(
                dst / rel, specs, lambda k, t=tensors, p=pad: _bundle_slice(t, k, p))
            stride = offsets[f"experts.1.{next(iter(stacked))}"] - \
                offsets[f"experts.0.{next(iter(stacked))}"] if num_experts > 1 else 0
            entry = {k: TensorEntry(offsets[f"experts.0.{k}"], stride, list(shape), dt,
                                    nbytes_of(shape[1:], dt))
                     for k, (shape, dt) in stacked.items()}
        plain = LayerEntry(i, ARCHS[mt].moe_attr, rel, entry,
                           sum(t.nbytes for t in entry.values()))
        entries[i] = replace(plain, bundle_crc32=bundle_checksums(dst / rel, plain))
        del tensors
    mx.clear_cache()

    # Config, tokenizer, manifest.
    out_cfg = {k: v for k, v in cfg.items() if k not in QUANT_KEYS}
    (dst / CONFIG_FILE).write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
    for name in [CONFIG_FILE, *_copy_side_files(src, dst)]:
        files[name] = _file_entry(dst / name)
    manifest = Manifest(
        model_type=mt, config=out_cfg,
        quantization=expert_quant.manifest_entry(quant, scales_dtype), num_experts=num_experts,
        top_k=int(cfg["num_experts_per_tok"]), layers=entries,
        files=files, resident_quantization=src_q, source=str(src), layout=layout, root=dst,
    )
    write_manifest(manifest, dst)
    return manifest


def bundled_specs(stacked: dict[str, tuple[tuple[int, ...], str]]
                  ) -> list[tuple[str, tuple[int, ...], str]]:
    """A bundled layer file's tensors in file order: per expert its slices (`experts.{e}.{name}`,
    the stacked tensor's shape without E), then `experts.{e}.pad` (uint8) up to the next ALIGN
    boundary when the bundle is not a multiple of it. The data section starts aligned
    (engine.safetensors_io), so every bundle does."""
    experts = next(iter(stacked.values()))[0][0]
    pad = bundle_pad(stacked)
    specs = []
    for e in range(experts):
        specs += [(f"experts.{e}.{k}", shape[1:], dt) for k, (shape, dt) in stacked.items()]
        if pad:
            specs.append((f"experts.{e}.pad", (pad,), "uint8"))
    return specs


def bundle_pad(stacked: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """Bytes from the end of a bundle to the next ALIGN boundary (0 when it is a multiple)."""
    return -sum(nbytes_of(shape[1:], dt) for shape, dt in stacked.values()) % ALIGN


def _bundle_slice(stacked: dict, name: str, pad: int):
    """The array a bundled spec names: expert e's slice of a stacked tensor, or `pad` zero
    bytes."""
    import mlx.core as mx

    _, e, key = name.split(".", 2)
    if key == "pad":
        return mx.zeros((pad,), mx.uint8)
    return stacked[key][int(e)]


def _file_entry(path: Path) -> FileEntry:
    from engine.manifest import sha256_file

    return FileEntry(path.stat().st_size, sha256_file(path))


def _evaluated(arr, path: Path, name: str):
    """`arr` evaluated (read, and computed when it is quantized here); read errors name the
    file they came from."""
    import mlx.core as mx

    try:
        mx.eval(arr)
    except Exception as err:  # noqa: BLE001
        raise BadInput(f"{path}: cannot read {name} ({err})") from None
    return arr


# ---------------------------------------------------------------- back to mlx-lm


def export_mlx(converted: Path, out_dir: Path) -> Path:
    """Write the converted model back as an ordinary (quantized) mlx-lm directory holding
    exactly the same numbers: float resident tensors upcast to float32, experts as stored.
    The fully resident reference for "same checkpoint" comparisons. Loads the whole model:
    for small models and tests."""
    import mlx.core as mx

    m = read_manifest(converted)
    verify_files(m)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {}
    for k, v in mx.load(str(m.path(RESIDENT_FILE))).items():
        weights[k] = v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
    for i, entry in m.layers.items():
        for name, v in stacked_experts(m, i).items():
            weights[f"model.layers.{i}.{entry.module}.{ARCHS[m.model_type].experts_attr}."
                    f"{name}"] = v
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = dict(m.config)
    q = {"group_size": m.quantization["group_size"], "bits": m.quantization["bits"],
         "mode": m.quantization.get("mode", "affine")}
    for k, v in (m.resident_quantization or {}).items():
        if isinstance(v, dict):
            q[k] = v
    cfg["quantization"] = q
    cfg["quantization_config"] = q
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for rel in m.files:
        if "/" not in rel and rel not in (RESIDENT_FILE, CONFIG_FILE):
            shutil.copyfile(m.path(rel), out_dir / rel)
    return out_dir
