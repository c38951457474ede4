"""The unmerged recovery LoRA (edge0 paper digest, section 3):

    y = W_int4(x) + (alpha / r) * B A x        (r = 16, alpha = 32 by default)

computed as a parallel delta, never merged into W (merging and re-quantizing erases most of it:
`engine.train.merge_loss`). The adapted modules are the resident projections of each decoder layer:
attention (or linear attention) and the shared expert. Never a router (a router decides which
experts stream, and the prerouter predicts it) and never a streamed routed expert (they are the
bytes on SSD, shared by every adapter).

The layer itself is mlx-lm's `LoRALinear` (lora_a [in, r], lora_b [r, out], `fuse()` to merge);
this module chooses the targets, and saves and checks adapters. An adapter is one safetensors
file whose metadata carries its description and provenance (base model sha, heads, K, training
phase, data), so a mismatched adapter is refused at load with one line, never applied silently.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.tuner.lora import LoRALinear

from contract.errors import BadInput

ADAPTER_FILE = "adapter.safetensors"
META_KEY = "ssdmoe_lora"
RANK, ALPHA = 16, 32.0
ATTENTION = ("self_attn", "attention", "linear_attn")  # the archs' attention module names
SHARED = ("shared_expert", "shared_experts")
# routers and the streamed experts (gpt_oss: `router`, `experts`)
NEVER = ("gate", "shared_expert_gate", "switch_mlp", "router", "experts")


@dataclass
class LoraSpec:
    rank: int = RANK
    alpha: float = ALPHA
    targets: list[str] = field(default_factory=list)  # e.g. model.layers.0.self_attn.q_proj
    # base_sha256 (the converted model's manifest.json), heads_sha256 (or None), top_k,
    # phase ("sft" | "distill"), data, seed, steps, ...
    provenance: dict = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_modules(model: nn.Module) -> list[str]:
    """Paths of every linear projection of a decoder layer's attention or shared expert."""
    out = []
    mods = _modules(model)
    for path, module in mods.items():
        parts = path.split(".")
        if not isinstance(module, nn.Linear | nn.QuantizedLinear | LoRALinear):
            continue
        if isinstance(mods.get(".".join(parts[:-1])), LoRALinear):
            continue  # the base inside an adapter
        if "layers" not in parts or any(p in NEVER for p in parts):
            continue
        if any(p in ATTENTION or p in SHARED for p in parts):
            out.append(path)
    return sorted(out, key=lambda t: [int(p) if p.isdigit() else p for p in t.split(".")])


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    return dict(model.named_modules())


def _dims(linear: nn.Module) -> tuple[int, int]:
    """(input, output) dims of a float or quantized linear."""
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits
    return in_dims, out_dims


def attach(model: nn.Module, spec: LoraSpec, seed: int = 0) -> LoraSpec:
    """Wrap every target of `model` in a fresh LoRALinear (A random, B zero: the model is
    unchanged until trained). Freezes the model but the adapters. Returns the spec with its
    targets filled in."""
    targets = spec.targets or target_modules(model)
    if not targets:
        raise BadInput("lora: the model has no attention or shared-expert projections to adapt")
    mx.random.seed(seed)
    mods = _modules(model)
    wrapped = [(t, LoRALinear.from_base(mods[t], r=spec.rank, scale=spec.scale))
               for t in targets]
    model.update_modules(tree_unflatten(wrapped))
    model.freeze()
    for _, m in wrapped:
        m.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    mx.eval(model.trainable_parameters())
    return LoraSpec(spec.rank, spec.alpha, list(targets), dict(spec.provenance))


def detach(model: nn.Module) -> None:
    """Put the base projections back (the model as served without an adapter)."""
    base = [(p, m.linear) for p, m in adapters(model).items()]
    if base:
        model.update_modules(tree_unflatten(base))


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """{path: LoRALinear} of the adapted projections."""
    return {p: m for p, m in _modules(model).items() if isinstance(m, LoRALinear)}


def adapter_arrays(model: nn.Module) -> dict[str, mx.array]:
    return {f"{p}.{k}": getattr(m, k) for p, m in adapters(model).items()
            for k in ("lora_a", "lora_b")}


def set_arrays(model: nn.Module, arrays: dict[str, mx.array]) -> None:
    """Put `adapter_arrays`-named tensors ({path}.lora_a / .lora_b) into the attached adapters."""
    mods = adapters(model)
    for key, value in arrays.items():
        path, attr = key.rsplit(".", 1)
        setattr(mods[path], attr, value)


def save(model: nn.Module, spec: LoraSpec, out_dir: Path) -> Path:
    """Write the adapter (atomic: a reader never sees half a file)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ADAPTER_FILE
    tmp = out_dir / (ADAPTER_FILE + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), adapter_arrays(model),
                        metadata={META_KEY: json.dumps(asdict(spec), sort_keys=True)})
    tmp.replace(path)
    return path


def read(src: Path) -> tuple[LoraSpec, dict[str, mx.array]]:
    """An adapter file (or its directory) -> (spec, arrays). Missing, truncated or not an
    adapter: BadInput naming the file."""
    src = Path(src)
    path = src / ADAPTER_FILE if src.is_dir() else src
    if not path.is_file():
        raise BadInput(f"{path}: no such file (an adapter directory holds {ADAPTER_FILE}; make "
                       "one with `ssdmoe train sft`)")
    from engine.safetensors_io import read_safetensors_header

    read_safetensors_header(path)  # truncation named before MLX reads a byte
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as err:  # noqa: BLE001 - mlx raises RuntimeError/ValueError on bad files
        raise BadInput(f"{path}: not a readable safetensors file (truncated?) ({err})") from None
    if META_KEY not in meta:
        raise BadInput(f"{path}: not an ssdmoe adapter (no {META_KEY!r} metadata)")
    try:
        spec = LoraSpec(**json.loads(meta[META_KEY]))
    except (ValueError, TypeError) as err:
        raise BadInput(f"{path}: adapter description unreadable ({err})") from None
    return spec, arrays


def read_provenance(src: Path) -> dict | None:
    """An adapter's provenance from its file header alone (no tensors read), or None when
    `src` holds no readable adapter."""
    from engine.safetensors_io import read_safetensors_header

    path = Path(src) / ADAPTER_FILE
    if not path.is_file():
        return None
    try:
        meta = read_safetensors_header(path)[1].get("__metadata__", {})
        return json.loads(meta[META_KEY])["provenance"]
    except (BadInput, KeyError, ValueError, TypeError):
        return None


def check(spec: LoraSpec, arrays: dict[str, mx.array], model: nn.Module, where: Path,
          base_sha256: str | None, top_k: int | None) -> None:
    """Refuse an adapter that does not fit `model`: one line naming the first mismatch."""
    prov = spec.provenance
    if base_sha256 is not None and prov.get("base_sha256") not in (None, base_sha256):
        raise BadInput(f"{where}: adapter was trained on base {prov['base_sha256'][:12]}, this "
                       f"model is {base_sha256[:12]} (manifest.json sha256)")
    if top_k is not None and prov.get("top_k") not in (None, top_k):
        raise BadInput(f"{where}: adapter was trained at K={prov['top_k']}, the model routes "
                       f"K={top_k} (changing K is a new adapter: train one with --top-k)")
    mods = _modules(model)
    for t in spec.targets:
        if t not in mods:
            raise BadInput(f"{where}: target module {t} does not exist in this model "
                           f"(layers or module names differ)")
        m = mods[t]
        base = m.linear if isinstance(m, LoRALinear) else m
        if not isinstance(base, nn.Linear | nn.QuantizedLinear):
            raise BadInput(f"{where}: target module {t} is a {type(base).__name__}, not a "
                           "linear projection")
        if any(p in NEVER for p in t.split(".")):
            raise BadInput(f"{where}: target module {t} is a router or a streamed expert; "
                           "adapters never touch those")
        in_dims, out_dims = _dims(base)
        for key, want in (("lora_a", (in_dims, spec.rank)), ("lora_b", (spec.rank, out_dims))):
            got = arrays.get(f"{t}.{key}")
            if got is None:
                raise BadInput(f"{where}: {t}.{key} missing from the adapter file")
            if tuple(got.shape) != want:
                raise BadInput(f"{where}: {t}.{key} is {tuple(got.shape)}, the model needs "
                               f"{want}")
    extra = set(arrays) - {f"{t}.{k}" for t in spec.targets for k in ("lora_a", "lora_b")}
    if extra:
        raise BadInput(f"{where}: tensor {sorted(extra)[0]} is not one of the adapter's targets")


@dataclass
class Installed:
    spec: LoraSpec
    source: str
    load_s: float  # read + check + wrap, seconds
    nbytes: int  # adapter parameter bytes as held in memory


def install(model: nn.Module, src: Path, base_sha256: str | None = None,
            top_k: int | None = None) -> Installed:
    """Read, check and apply an adapter to a loaded model (resident or streaming): the
    adapted projections become LoRALinear(base, lora_a, lora_b), unmerged."""
    t0 = time.perf_counter()
    spec, arrays = read(src)
    check(spec, arrays, model, Path(src), base_sha256, top_k)
    attach(model, spec)
    set_arrays(model, {k: v.astype(mx.float32) for k, v in arrays.items()})
    model.freeze()
    mx.eval(model.parameters())
    nbytes = sum(a.nbytes for a in adapter_arrays(model).values())
    return Installed(spec, str(src), time.perf_counter() - t0, nbytes)
