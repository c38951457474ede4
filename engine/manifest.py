"""The streaming checkpoint's manifest: what `convert` wrote and where each expert's bytes are.
Plain JSON + dataclasses, no MLX (the simulator may read it too).

A converted directory holds:
  manifest.json              this file's content (written last: its presence means complete)
  config.json                the model config (mlx-lm format, without `quantization`)
  resident.safetensors       every parameter except the routed experts, mlx-lm names
  experts/layer_XXX.safetensors  per MoE layer, the routed experts' tensors: per projection
                             {gate,up,down}_proj: weight and scales always, biases in affine
                             mode (mxfp4/mxfp8/nvfp4 have none), bias where the architecture's
                             experts have one (gpt_oss); in the checkpoint's own quantization
                             unless converted with --requantize
  tokenizer files            copied from the source

A "bundle" is one expert's slices of every tensor of its layer. Two layouts of a layer file:
- "bundled" (version 2, what `convert` writes): E bundles in expert order, each its slices back
  to back (tensors `experts.{e}.{name}`), each bundle starting on an ALIGN boundary (a
  `experts.{e}.pad` uint8 tensor fills the gap where a bundle is not a multiple of it): one
  expert is one contiguous range, read with one vectored read. Still a plain safetensors file.
- "stacked" (version 1): one tensor [E, ...] per name, so a bundle is as many ranges as tensors,
  far apart. Still read (a re-convert is not forced), and written by `convert --layout stacked`
  so that benchmarks can compare the two read patterns in one run.
Expert e's slice of tensor t lives at bytes [offset + e * stride, offset + e * stride + nbytes)
(absolute file offsets, header included; stacked: stride == nbytes).
`bundle_bytes` = the sum of the slices' nbytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from contract.errors import BadInput, read_json_object

FORMAT = "ssdmoe-streaming"
VERSION = 2
LAYOUTS = ("bundled", "stacked")
LAYOUT_OF_VERSION = {1: "stacked", 2: "bundled"}  # a v2 manifest names its layout
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
RESIDENT_FILE = "resident.safetensors"
EXPERTS_DIR = "experts"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "scales", "biases", "bias")  # file order within a projection


def expert_tensor_names(affine: bool = True, linear_bias: bool = False) -> tuple[str, ...]:
    """A layer file's tensor names in file order: per projection its packed weight and scales,
    `biases` (the affine offsets) in affine mode, `bias` (added after the matmul) when the
    architecture's experts have one."""
    parts = ("weight", "scales") + (("biases",) if affine else ()) + \
        (("bias",) if linear_bias else ())
    return tuple(f"{p}.{q}" for p in PROJECTIONS for q in parts)


TENSOR_NAMES = expert_tensor_names()  # int4 affine, no expert bias: 9 names (the default)

# Files above this size are only hashed on an explicit full verify (sizes are always checked).
AUTO_HASH_LIMIT = 256 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    offset: int  # absolute byte offset of expert 0's slice in the layer file
    stride: int  # bytes from one expert's slice to the next's
    shape: list[int]  # full stacked shape [E, ...]
    dtype: str  # dtype name: "uint32", "float32", "bfloat16", "float16", "uint8"
    nbytes: int  # bytes of one expert's slice (== stride in the stacked layout)


@dataclass(frozen=True)
class LayerEntry:
    layer: int
    module: str  # attribute of the decoder layer holding the MoE block ("mlp", "block_sparse_moe")
    file: str  # relative path
    tensors: dict[str, TensorEntry]
    bundle_bytes: int
    # zlib crc32 of each expert's slices in file order (engine.store checks cold reads against
    # them where asked); empty in manifests converted before they were written
    bundle_crc32: tuple[int, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The layer's tensor names in file order (the order a bundle's ranges are read in)."""
        return tuple(self.tensors)

    def expert_range(self, name: str, expert: int) -> tuple[int, int]:
        """(offset, length) of `expert`'s slice of tensor `name`."""
        t = self.tensors[name]
        return t.offset + expert * t.stride, t.nbytes

    @property
    def experts(self) -> int:
        return next(iter(self.tensors.values())).shape[0]


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass
class Manifest:
    model_type: str
    config: dict
    # the routed experts': {"bits", "group_size", "mode", "scales_dtype", "requantized"}
    # (requantized: False when the checkpoint's own quantized experts were kept as they are)
    quantization: dict
    num_experts: int
    top_k: int
    layers: dict[int, LayerEntry]
    files: dict[str, FileEntry]  # every file of the directory but manifest.json
    resident_quantization: dict | None = None  # the source's mlx-lm `quantization`, if any
    source: str = ""
    format: str = FORMAT
    version: int = VERSION
    layout: str = "bundled"  # LAYOUTS
    root: Path = field(default=Path("."), compare=False)

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.layers)

    @property
    def bundle_bytes(self) -> int:
        """Bytes of one expert bundle (same for every layer in the supported architectures)."""
        return max(e.bundle_bytes for e in self.layers.values())

    def path(self, rel: str) -> Path:
        return self.root / rel

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("root")
        d["layers"] = [{k: v for k, v in asdict(self.layers[i]).items()
                        if k != "bundle_crc32" or v} for i in self.moe_layers]
        d["bundle_bytes"] = self.bundle_bytes
        return d


def bundle_checksums(path: Path, entry: LayerEntry) -> tuple[int, ...]:
    """zlib crc32 of each expert's slices of `entry`'s file, in file order (what
    LayerEntry.bundle_crc32 records)."""
    out = []
    with open(path, "rb") as f:
        for e in range(entry.experts):
            crc = 0
            for name in entry.names:
                offset, length = entry.expert_range(name, e)
                crc = zlib.crc32(os.pread(f.fileno(), length, offset), crc)
            out.append(crc)
    return tuple(out)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(manifest: Manifest, root: Path) -> Path:
    """Atomic write: a reader never sees a half-written manifest."""
    path = Path(root) / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
    tmp.replace(path)
    return path


def _parse(d: dict, root: Path) -> Manifest:
    layers = {}
    for e in d["layers"]:
        tensors = {n: TensorEntry(**{"nbytes": t["stride"], **t})  # v1: the slice is the stride
                   for n, t in e["tensors"].items()}
        missing = {f"{p}.{q}" for p in PROJECTIONS for q in ("weight", "scales")} - set(tensors)
        if d["quantization"].get("mode", "affine") == "affine":
            missing |= {f"{p}.biases" for p in PROJECTIONS} - set(tensors)
        if missing:
            raise KeyError(f"layer {e['layer']} lacks tensors {sorted(missing)}")
        crcs = tuple(int(c) for c in e.get("bundle_crc32", ()))
        experts = next(iter(tensors.values())).shape[0]
        if crcs and len(crcs) != experts:
            raise ValueError(f"layer {e['layer']}: {len(crcs)} bundle checksums for {experts} "
                             "experts")
        layers[int(e["layer"])] = LayerEntry(
            layer=int(e["layer"]), module=e["module"], file=e["file"], tensors=tensors,
            bundle_bytes=int(e["bundle_bytes"]), bundle_crc32=crcs,
        )
    return Manifest(
        model_type=d["model_type"], config=d["config"], quantization=d["quantization"],
        num_experts=int(d["num_experts"]), top_k=int(d["top_k"]), layers=layers,
        files={k: FileEntry(**v) for k, v in d["files"].items()},
        resident_quantization=d.get("resident_quantization"), source=d.get("source", ""),
        format=d["format"], version=int(d["version"]), layout=d["layout"], root=root,
    )


def read_manifest(root: Path) -> Manifest:
    """Parse and check the manifest's own structure (not the files: see `verify_files`)."""
    root = Path(root)
    path = root / MANIFEST_FILE
    if not root.is_dir():
        raise BadInput(f"{root}: not a directory (expected a converted model: ssdmoe convert)")
    d = read_json_object(path, "missing (not a converted model, or conversion did not finish)")
    if d.get("format") != FORMAT:
        raise BadInput(f"{path}: not an {FORMAT} manifest")
    if d.get("version") not in LAYOUT_OF_VERSION:
        raise BadInput(f"{path}: layout version {d.get('version')!r} unknown (this engine reads "
                       f"{', '.join(map(str, LAYOUT_OF_VERSION))}): re-convert the checkpoint "
                       "with ssdmoe convert")
    d = {"layout": LAYOUT_OF_VERSION[d["version"]], **d}  # version 1 names no layout
    if d["layout"] not in LAYOUTS:
        raise BadInput(f"{path}: layout {d['layout']!r} unknown (one of: "
                       f"{', '.join(LAYOUTS)}): re-convert the checkpoint with ssdmoe convert")
    try:
        return _parse(d, root)
    except (KeyError, TypeError, ValueError) as err:
        raise BadInput(f"{path}: malformed manifest ({type(err).__name__}: {err})") from None


def verify_files(manifest: Manifest, full_hash: bool | None = None) -> None:
    """Sizes always; sha256 of every file when `full_hash`, of files up to AUTO_HASH_LIMIT bytes
    when None (so small models are fully checked at every load), of none when False."""
    for rel, entry in sorted(manifest.files.items()):
        path = manifest.path(rel)
        if not path.is_file():
            raise BadInput(f"{path}: missing (listed in {MANIFEST_FILE})")
        size = path.stat().st_size
        if size != entry.size:
            what = "truncated" if size < entry.size else "larger than expected"
            raise BadInput(f"{path}: {what}: {size} bytes, {MANIFEST_FILE} says {entry.size}")
    for rel, entry in sorted(manifest.files.items()):
        if full_hash is False or (full_hash is None and entry.size > AUTO_HASH_LIMIT):
            continue
        path = manifest.path(rel)
        if sha256_file(path) != entry.sha256:
            raise BadInput(f"{path}: sha256 does not match {MANIFEST_FILE} (changed or corrupt)")
