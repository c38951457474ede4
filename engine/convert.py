"""`convert`: an mlx-lm MoE checkpoint -> the streaming layout (see engine/manifest.py).

Decisions:
- Routed experts are written int4 (or `bits`) affine with group size `group_size` and float32
  scales/biases (on CPU float32 scales are several times faster than bf16: machine-notes).
  A float source is quantized the mlx-lm way (`mx.quantize` on the stacked [E, out, in]
  tensor, which is what `SwitchLinear.to_quantized` does), so a resident mlx-lm model quantized
  with the same settings holds the same numbers. A quantized source with the same bits/group
  size is copied (scales upcast to float32); otherwise it is dequantized and requantized.
- The resident part (attention, embeddings, norms, routers, shared experts, dense MLPs) is
  copied as it is in the source, float or quantized, under its mlx-lm (post-sanitize) names.
  The loader upcasts float tensors to float32 on CPU; requantizing them is not this module's job.
- Streaming: the source is opened with `mx.load` (lazy: a tensor is read when evaluated), each
  output tensor is evaluated, written and dropped in turn, and safetensors headers are computed
  up front from shapes, so peak memory is about one stacked expert tensor, never the model.
- Each written safetensors file has its data section starting at a 4096-byte boundary (the
  header is padded with spaces, which the format allows), for O_DIRECT whole-tensor reads.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from collections.abc import Callable
from importlib import import_module
from pathlib import Path

from contract.errors import BadInput, read_json_object
from engine.archs import ARCHS, arch_for
from engine.manifest import (
    CONFIG_FILE,
    EXPERTS_DIR,
    MANIFEST_FILE,
    PARTS,
    PROJECTIONS,
    RESIDENT_FILE,
    TENSOR_NAMES,
    FileEntry,
    LayerEntry,
    Manifest,
    TensorEntry,
    read_manifest,
    verify_files,
    write_manifest,
)

ALIGN = 4096
_ST_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL",
}
QUANT_KEYS = ("quantization", "quantization_config")
Progress = Callable[[str], None]


def dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


# ---------------------------------------------------------------- safetensors, read side


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(data_start, header dict) after checking the file holds every byte the header promises."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise BadInput(f"{path}: truncated: no safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000 or 8 + n > size:
                raise BadInput(f"{path}: truncated or not a safetensors file (header {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as err:
        raise BadInput(f"{path}: cannot read ({err.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadInput(f"{path}: not a safetensors file (bad header)") from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end > size:
        raise BadInput(f"{path}: truncated: {size} bytes, header needs {8 + n + end}")
    return 8 + n, header


# ---------------------------------------------------------------- safetensors, write side


class _HashingWriter:
    """A file written front to back with its sha256 computed on the way."""

    def __init__(self, path: Path):
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.f.write(mv)
        self.sha.update(mv)
        self.size += mv.nbytes

    def close(self) -> FileEntry:
        self.f.close()
        return FileEntry(self.size, self.sha.hexdigest())


def write_safetensors(
    path: Path, specs: list[tuple[str, tuple[int, ...], str]], produce: Callable, metadata=None
) -> tuple[FileEntry, dict[str, int]]:
    """Write tensors `specs` = [(name, shape, dtype name)] in order; `produce(name)` returns the
    (lazy) mx.array for a name when its turn comes. Returns (file entry, absolute offsets)."""
    import mlx.core as mx

    header: dict = {"__metadata__": metadata or {"format": "mlx"}}
    offsets, pos = {}, 0
    for name, shape, dt in specs:
        nbytes = _nbytes(shape, dt)
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape),
                        "data_offsets": [pos, pos + nbytes]}
        offsets[name] = pos
        pos += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)
    data_start = 8 + len(blob)
    out = _HashingWriter(path)
    try:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for name, shape, dt in specs:
            arr = mx.contiguous(produce(name))
            mx.eval(arr)
            if tuple(arr.shape) != tuple(shape) or dtype_name(arr.dtype) != dt:
                raise AssertionError(f"{name}: produced {arr.shape} {arr.dtype}, "
                                     f"header says {shape} {dt}")
            out.write(memoryview(arr))
            del arr
    finally:
        entry = out.close()
    return entry, {k: data_start + v for k, v in offsets.items()}


def _nbytes(shape, dt: str) -> int:
    n = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1, "uint16": 2,
         "uint32": 4, "uint64": 8, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1}[dt]
    for d in shape:
        n *= int(d)
    return n


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
    attr = ARCHS[model_type].moe_attr
    out = {}
    for i, layer in enumerate(model.layers):
        block = getattr(layer, attr, None)
        if block is not None and hasattr(block, "switch_mlp"):
            out[i] = f"model.layers.{i}.{attr}.switch_mlp"
    return out


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


def _load_source(src: Path, cfg: dict) -> tuple[dict, dict[str, Path]]:
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
    return weights, where


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


def _expert_specs(e: int, out_in: dict[str, tuple[int, int]], bits: int, gs: int):
    specs = []
    for proj in PROJECTIONS:
        out_dim, in_dim = out_in[proj]
        specs.append((f"{proj}.weight", (e, out_dim, in_dim * bits // 32), "uint32"))
        specs.append((f"{proj}.scales", (e, out_dim, in_dim // gs), "float32"))
        specs.append((f"{proj}.biases", (e, out_dim, in_dim // gs), "float32"))
    return specs


def convert(src: Path, dst: Path, bits: int = 4, group_size: int = 64,
            progress: Progress | None = None) -> Manifest:
    """Convert the mlx-lm MoE checkpoint directory `src` into the streaming layout at `dst`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    src, dst = Path(src), Path(dst)
    say = progress or (lambda _msg: None)
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
        raise BadInput(f"--bits {bits} --group-size {group_size}: unsupported "
                       "(bits 2-8, group size 32/64/128)")
    if not src.is_dir():
        raise BadInput(f"{src}: not a directory")
    cfg_path = src / CONFIG_FILE
    cfg = read_config(cfg_path)
    mt = cfg["model_type"]
    src_q = _source_quantization(cfg, cfg_path)
    model = build_skeleton(cfg, cfg_path)
    weights, where = _load_source(src, cfg)
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

    # Expert tensors by layer; refuse what the kernel contract does not cover.
    expert_keys: dict[int, dict[str, dict[str, str]]] = {}
    for i, prefix in layers.items():
        keys = {k for k in expected if k.startswith(prefix + ".")}
        if any(k.endswith(".bias") for k in keys):
            raise BadInput(f"{cfg_path}: routed experts with biases are not supported")
        expert_keys[i] = {p: {q: f"{prefix}.{p}.{q}" for q in PARTS} for p in PROJECTIONS}
    routed = {k for i in layers for k in expected if k.startswith(layers[i] + ".")}

    num_experts = int(cfg[ARCHS[mt].experts_key])
    out_in: dict[int, dict[str, tuple[int, int]]] = {}  # layer -> projection -> (out, in)
    for i in layers:
        out_in[i] = {}
        for p in PROJECTIONS:
            sw = getattr(getattr(model.layers[i], ARCHS[mt].moe_attr).switch_mlp, p)
            out_in[i][p] = (sw.output_dims, sw.input_dims)
            if sw.input_dims % group_size:
                raise BadInput(f"{cfg_path}: {p} input size {sw.input_dims} is not a multiple "
                               f"of --group-size {group_size}")

    dst.mkdir(parents=True, exist_ok=True)
    (dst / EXPERTS_DIR).mkdir(exist_ok=True)
    (dst / MANIFEST_FILE).unlink(missing_ok=True)  # an interrupted run leaves no manifest
    files: dict[str, FileEntry] = {}

    # Resident part.
    resident_names = sorted(k for k in expected if k not in routed)
    specs = [(k, tuple(weights[k].shape), dtype_name(weights[k].dtype)) for k in resident_names]
    say(f"resident: {len(specs)} tensors")
    files[RESIDENT_FILE], _ = write_safetensors(
        dst / RESIDENT_FILE, specs, lambda k: _take(weights, k, where, src))

    # Routed experts, one file per MoE layer.
    entries = {}
    for i in sorted(layers):
        say(f"layer {i}: experts")
        rel = f"{EXPERTS_DIR}/layer_{i:03d}.safetensors"
        cache: dict[str, object] = {}

        def produce(name: str, i=i, cache=cache):
            proj, part = name.split(".")
            if part == "weight":
                cache.clear()
                sw = getattr(getattr(model.layers[i], ARCHS[mt].moe_attr).switch_mlp, proj)
                cache.update(_quantized(weights, expert_keys[i][proj], sw, bits, group_size,
                                        where, src))
            return cache.pop(part)

        specs = _expert_specs(num_experts, out_in[i], bits, group_size)
        files[rel], offsets = write_safetensors(dst / rel, specs, produce)
        tensors = {}
        for name, shape, dt in specs:
            stride = _nbytes(shape[1:], dt)
            tensors[name] = TensorEntry(offsets[name], stride, list(shape), dt)
        assert tuple(tensors) == TENSOR_NAMES
        entries[i] = LayerEntry(i, ARCHS[mt].moe_attr, rel, tensors,
                                sum(t.stride for t in tensors.values()))
    mx.clear_cache()

    # Config, tokenizer, manifest.
    out_cfg = {k: v for k, v in cfg.items() if k not in QUANT_KEYS}
    (dst / CONFIG_FILE).write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
    for name in [CONFIG_FILE, *_copy_side_files(src, dst)]:
        files[name] = _file_entry(dst / name)
    manifest = Manifest(
        model_type=mt, config=out_cfg,
        quantization={"bits": bits, "group_size": group_size, "mode": "affine",
                      "scales_dtype": "float32"},
        num_experts=num_experts, top_k=int(cfg["num_experts_per_tok"]), layers=entries,
        files=files, resident_quantization=src_q, source=str(src), root=dst,
    )
    write_manifest(manifest, dst)
    return manifest


def _file_entry(path: Path) -> FileEntry:
    from engine.manifest import sha256_file

    return FileEntry(path.stat().st_size, sha256_file(path))


def _take(weights: dict, key: str, where: dict, src: Path):
    """Pop a source tensor (so it is freed once written); read errors name the file."""
    import mlx.core as mx

    arr = weights.pop(key)
    try:
        mx.eval(arr)
    except Exception as err:  # noqa: BLE001
        raise BadInput(f"{where.get(key, src)}: cannot read {key} ({err})") from None
    return arr


def _quantized(weights: dict, keys: dict[str, str], sw, bits: int, gs: int,
               where: dict, src: Path) -> dict:
    """{"weight","scales","biases"} of one stacked projection at the target quantization.
    `sw` is the skeleton's (Quantized)SwitchLinear: it knows the source's own quantization."""
    import mlx.core as mx

    w = _take(weights, keys["weight"], where, src)
    if keys["scales"] in weights:  # quantized source
        scales = _take(weights, keys["scales"], where, src)
        biases = _take(weights, keys["biases"], where, src) if keys["biases"] in weights else None
        if getattr(sw, "global_scale", None) is not None:
            raise BadInput(f"{where.get(keys['weight'], src)}: experts with a global scale "
                           f"({sw.mode}) are not supported")
        if sw.mode == "affine" and sw.bits == bits and sw.group_size == gs:
            return {"weight": w, "scales": scales.astype(mx.float32),
                    "biases": biases.astype(mx.float32)}
        w = mx.dequantize(w, scales, biases, sw.group_size, sw.bits, mode=sw.mode)
    q, s, b = mx.quantize(w.astype(mx.float32), gs, bits)
    return {"weight": q, "scales": s, "biases": b}


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
        for name, v in mx.load(str(m.path(entry.file))).items():
            weights[f"model.layers.{i}.{entry.module}.switch_mlp.{name}"] = v
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = dict(m.config)
    q = {"group_size": m.quantization["group_size"], "bits": m.quantization["bits"],
         "mode": "affine"}
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
