"""A simulator model profile derived from a converted model's manifest (engine/manifest.py's
JSON, read here with plain json: no engine import, no MLX), so any captured trace can be
replayed: `ssdmoe sim profile-model MODEL_DIR --out scenarios/models/NAME.toml`, and
automatically by `ssdmoe sim compare` when no profile file exists.

What each value is, for a model run by this project's engine on CPU:
  layers, experts, k, bundle_bytes    manifest (config num_hidden_layers, num_experts, top_k,
                                      bundle_bytes)
  resident_bytes                      resident.safetensors tensors as the engine holds them
                                      (float tensors upcast to float32 on CPU)
  active_params                       resident parameters (the embedding table once: its
                                      lookup reads one row, a tied lm_head reads all of it) +
                                      layers x K x one expert's parameters
  kv_bytes_per_token                  2 x layers x kv_heads x head_dim x 4 (float32 cache)
  build_ms_per_layer                  given (measured by `ssdmoe calibrate`), else machine-notes
  consumer_first/last, heads,         MODEL/prerouter/prerouter.json when present (else no heads:
  head_bytes, head_read_bytes         consumer_first = consumer_last = -1)
  lora_bytes                          the served adapter's tensors (MODEL/lora/k{K}-distill, else
                                      -sft: the safetensors header), float32 as held
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from contract.errors import BadInput, read_json_object
from contract.thresholds import PAGE
from sim.scenario import MODEL_KEYS

MANIFEST = "manifest.json"
RESIDENT = "resident.safetensors"
LORA_FILE = "adapter.safetensors"  # engine.lora.ADAPTER_FILE
DEFAULT_BUILD_MS = 0.25  # machine-notes: tiny model graph building ~1.7-2.3 ms over 8 layers
_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1, "F64": 8,
          "I64": 8, "U16": 2, "I16": 2, "BOOL": 1}
_FLOAT = {"F32", "F16", "BF16", "F64"}


def read_manifest_json(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / MANIFEST
    data = read_json_object(path, "missing (not a converted model: ssdmoe convert)")
    for key in ("config", "num_experts", "top_k", "bundle_bytes", "layers"):
        if key not in data:
            raise BadInput(f"{path}: {key}: missing (not an ssdmoe-streaming manifest?)")
    return data


def safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"{path}: not a readable safetensors file ({err})") from None
    header.pop("__metadata__", None)
    return header


def elements(shape: list[int]) -> int:
    """Number of elements of a tensor of this shape."""
    return math.prod(int(d) for d in shape)


def resident_figures(path: Path, bits: int | None) -> tuple[int, int, int]:
    """(bytes as held on CPU, parameters, embedding parameters) of the resident file."""
    nbytes = params = embed = 0
    for name, t in safetensors_header(path).items():
        count = elements(t["shape"])
        dtype = t["dtype"]
        nbytes += count * (4 if dtype in _FLOAT else _BYTES.get(dtype, 4))
        if name.endswith((".scales", ".biases")):
            continue
        n = count * 32 // bits if dtype == "U32" and bits else count
        params += n
        if "embed_tokens" in name or name.endswith("wte.weight"):
            embed += n
    return nbytes, params, embed




def layout_of(manifest: dict[str, Any]) -> str:
    """"bundled" (one contiguous range per expert) or "stacked" (a range per tensor): the
    manifest's own word, else what its version means (engine.manifest: 1 stacked, 2 bundled;
    none, a hand-made manifest of the first kind: stacked)."""
    if manifest.get("layout"):
        return str(manifest["layout"])
    return "bundled" if int(manifest.get("version") or 1) >= 2 else "stacked"


def _slices(manifest: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    """(offset, stride, nbytes, experts) of each tensor of the first MoE layer."""
    return [(int(t["offset"]), int(t["stride"]), int(t.get("nbytes", t["stride"])),
             int(t["shape"][0])) for t in manifest["layers"][0]["tensors"].values()]


def _pages(start: int, length: int) -> int:
    return -(-(start + length) // PAGE) - start // PAGE


def paged_bundle_bytes(manifest: dict[str, Any]) -> float:
    """Mean bytes of one bundle's ranges rounded out to whole pages (what the kernel reads, and
    what the engine's page-cache budget charges: engine.store), over the first MoE layer. In
    the bundled layout the ranges are one: the bundle's span."""
    slices = _slices(manifest)
    experts = slices[0][3] if slices else 0
    total = 0
    for e in range(experts):
        ranges = sorted((off + e * stride, nbytes) for off, stride, nbytes, _ in slices)
        if layout_of(manifest) == "bundled":
            ranges = [(ranges[0][0], ranges[-1][0] + ranges[-1][1] - ranges[0][0])]
        total += sum(_pages(start, n) for start, n in ranges) * PAGE
    return total / experts if experts else 0.0


def shared_page_slices(manifest: dict[str, Any]) -> tuple[int, int]:
    """(slices, group) over the first MoE layer: a bundle's tensor slices smaller than a page
    that share their page with the same slice of `group` - 1 other experts (page-aligned
    tensors whose stride divides the page; expert e's group is e // group). With several such
    strides, the smallest group: a page is taken as cached only when one of those experts
    read it. (0, 1) when no slice shares a page this way (a larger slice's edge pages are
    device_bundle_bytes' concern), or when every slice is one. The bundled layout starts
    every bundle on a page: no page is shared."""
    if layout_of(manifest) == "bundled":
        return 0, 1
    strides = [(int(t["offset"]), int(t["stride"]))
               for t in manifest["layers"][0]["tensors"].values()]
    groups = [PAGE // stride for off, stride in strides
              if stride < PAGE and PAGE % stride == 0 and off % PAGE == 0]
    slices = len(manifest["layers"][0]["tensors"])
    # a bundle of shared slices alone is not modelled (sim.profiles.check_model)
    return (len(groups), min(groups)) if groups and len(groups) < slices else (0, 1)


def reads_per_load(manifest: dict[str, Any], iov_max: int = 1024) -> tuple[int, int]:
    """(reads of one bundle, reads of a whole layer) the engine's store makes
    (engine.read_plan): bundled, one vectored read per bundle and ceil(iovecs / IOV_MAX) per
    layer; stacked, one per tensor either way."""
    tensors = len(manifest["layers"][0]["tensors"])
    if layout_of(manifest) != "bundled":
        return tensors, tensors
    experts = _slices(manifest)[0][3]
    padded = int(manifest["bundle_bytes"]) % PAGE != 0
    per_bundle = tensors + (1 if padded else 0)
    return 1, max(1, -(-(experts * per_bundle) // iov_max)) if iov_max > per_bundle \
        else experts


def unembed_bytes(path: Path, tied: bool) -> int:
    """Bytes of the output projection as held on CPU: lm_head (with its scales and biases when
    quantized), or the token embedding when the two are tied."""
    want = ("embed_tokens", "wte.") if tied else ("lm_head",)
    nbytes = 0
    for name, t in safetensors_header(path).items():
        if not any(w in name for w in want):
            continue
        nbytes += elements(t["shape"]) * (4 if t["dtype"] in _FLOAT else _BYTES.get(t["dtype"], 4))
    return nbytes


def expert_params(manifest: dict[str, Any]) -> int:
    """Parameters of one expert: sum over gate/up/down of out x in (in from packed words)."""
    bits = int(manifest.get("quantization", {}).get("bits", 4))
    first = manifest["layers"][0]["tensors"]
    total = 0
    for proj in ("gate_proj", "up_proj", "down_proj"):
        shape = first[f"{proj}.weight"]["shape"]
        total += int(shape[1]) * int(shape[2]) * 32 // bits
    return total


def profile_from_manifest(model_dir: str | Path, build_ms_per_layer: float | None = None,
                          build_how: str | None = None) -> dict[str, tuple[Any, str]]:
    """Model-profile keys -> (value, where it came from), for `model_toml`."""
    model_dir = Path(model_dir)
    m = read_manifest_json(model_dir)
    cfg = m["config"]
    src = f"{model_dir / MANIFEST}"
    layers = int(cfg.get("num_hidden_layers") or len(m["layers"]))
    moe = len(m["layers"])
    reads = len(m["layers"][0]["tensors"])
    layout = layout_of(m)
    bundle_reads, layer_reads = reads_per_load(m)
    shared, group = shared_page_slices(m)
    resident_path = model_dir / RESIDENT
    if not resident_path.is_file():
        raise BadInput(f"{resident_path}: missing")
    rq = m.get("resident_quantization") or {}
    res_bytes, res_params, embed = resident_figures(resident_path, rq.get("bits"))
    k = int(m["top_k"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    per_expert = expert_params(m)
    active = res_params - (0 if tied else embed) + moe * k * per_expert
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // heads)
    kv = 2 * layers * kv_heads * head_dim * 4
    if build_ms_per_layer is None:
        build_ms_per_layer = DEFAULT_BUILD_MS
        build_how = ("machine-notes: tiny qwen3_moe graph building ~1.7-2.3 ms/step over 8 layers "
                     "(not measured for this model: run ssdmoe calibrate --model DIR --model-out)")
    note_layers = "" if moe == layers else f" ({moe} are MoE layers: the sim treats all as MoE)"
    return {
        "layers": (layers, f"{src}: config num_hidden_layers{note_layers}"),
        "experts": (int(m["num_experts"]), f"{src}: num_experts"),
        "k": (k, f"{src}: top_k"),
        "bundle_bytes": (int(m["bundle_bytes"]), f"{src}: bundle_bytes ({reads} tensor slices)"),
        "resident_bytes": (res_bytes, f"{resident_path.name} tensors as held on CPU (floats "
                           "upcast to float32)"),
        "active_params": (float(active), (
            f"resident params {res_params}{'' if tied else f' - embedding {embed}'} + {moe} "
            f"MoE layers x K={k} x {per_expert} params per expert")),
        "device_bundle_bytes": (int(round(paged_bundle_bytes(m))), (
            f"{src}: a bundle's {'one range' if layout == 'bundled' else f'{reads} ranges'} "
            f"rounded out to {PAGE}-byte pages, mean over the first MoE layer: what a cold read "
            "moves from the device")),
        "unembed_bytes": (unembed_bytes(resident_path, tied), (
            f"{resident_path.name}: {'the tied token embedding' if tied else 'lm_head'} as held "
            "on CPU (read once per step, after the last layer)")),
        "kv_bytes_per_token": (kv, f"2 x {layers} layers x {kv_heads} KV heads x head_dim "
                               f"{head_dim} x 4 bytes (float32 cache)"),
        **heads_profile(model_dir / "prerouter" / "prerouter.json"),
        **lora_profile(next((d for d in (model_dir / "lora" / f"k{k}-{phase}"
                                         for phase in ("distill", "sft"))
                             if (d / LORA_FILE).is_file()), None)),
        "build_ms_per_layer": (round(float(build_ms_per_layer), 4), build_how or "given"),
        "whole_layer_reads": (layer_reads, (
            f"{src}: {layout} layout: a whole layer is {layer_reads} vectored read(s) "
            "(engine.read_plan; IOV_MAX 1024)" if layout == "bundled" else
            f"{src}: stacked layout: {reads} tensors in the first MoE layer file, one read each")),
        "bundle_reads": (bundle_reads, (
            f"{src}: bundled layout: a bundle is one contiguous range of {reads} slices, one "
            "vectored read (engine.store, engine.read_plan)" if layout == "bundled" else
            f"{src}: stacked layout: a bundle is {reads} tensor slices, each its own pread "
            "(engine.store: no readahead)")),
        **({"shared_page_reads": (shared, (
            f"{src}: {shared} of the {reads} slices are smaller than a {PAGE}-byte page and "
            f"share it with {group - 1} other expert(s) (sim.page_cache)")),
            "page_group": (group, f"{src}: {PAGE}-byte page / the largest such slice stride")}
           if shared else {}),
    }


def heads_profile(meta: Path) -> dict[str, tuple[Any, str]]:
    """Model-profile keys of prerouter heads from their prerouter.json (engine.prerouter),
    or "no heads" when the file does not exist. BadInput when it exists but is unreadable."""
    if not meta.is_file():
        none = f"no prediction heads ({meta} absent: ssdmoe train heads makes them)"
        return {"consumer_first": (-1, none), "consumer_last": (-1, "no prediction heads"),
                "heads": (0, "no prediction heads"), "head_bytes": (0, "no prediction heads"),
                "head_read_bytes": (0, "no prediction heads"),
                "head_build_ms": (0.0, "no prediction heads")}
    try:
        spec = json.loads(meta.read_text())
        owners = [int(n) for n in spec["owners"]]
        d, e, h = int(spec["dims"]), int(spec["experts"]), int(spec["hidden"])
        k = int(spec.get("top_k", e))  # unknown: the whole table, as a dense head reads it
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BadInput(f"{meta}: not a prerouter description ({type(err).__name__}: {err})") \
            from None
    if not owners or owners != list(range(owners[0], owners[-1] + 1)):
        raise BadInput(f"{meta}: owners {owners} are not one range of consecutive layers, "
                       "which the simulator's model profile needs")
    dense = (d + 1) * (h + e) + (h + 1) * e  # the projection and fc2, float32 below
    head_bytes = 4 * (dense + 2 * e * (h + e))  # and the one-hot table, 2E rows
    # a step reads the dense parts, and of the table the 2K rows of this token's and the
    # previous token's experts (engine.prerouter.StackedHeads: a lookup)
    read_bytes = 4 * (dense + 2 * k * (h + e))
    src = f"{meta}: owners {owners[0]}-{owners[-1]}"
    return {"consumer_first": (owners[0] + 1, f"{src} (owner N predicts layer N+1)"),
            "consumer_last": (owners[-1] + 1, src),
            "heads": (len(owners), src),
            "head_bytes": (head_bytes, f"{meta}: float32 proj, one-hot table and fc2 of width {h}"),
            "head_read_bytes": (read_bytes, f"{meta}: proj and fc2, and {2 * k} of the table's "
                                f"{2 * e} rows a step (gathered)"),
            "head_build_ms": (0.0, "not measured (the heads run as one batched flush per step)")}


def lora_profile(adapter_dir: Path | None) -> dict[str, tuple[Any, str]]:
    """Model-profile keys of a recovery LoRA from its file's header (no MLX), or none."""
    if adapter_dir is None:
        return {"lora_bytes": (0, "no adapter (ssdmoe train sft makes one)"),
                "lora_build_ms": (0.0, "no adapter")}
    path = Path(adapter_dir) / LORA_FILE
    tensors = safetensors_header(path)
    count = sum(1 for name in tensors if name.endswith("lora_a"))
    params = sum(elements(t["shape"]) for t in tensors.values())
    return {"lora_bytes": (4 * params, f"{path}: {count} adapted projections, {params} "
                           "parameters as float32"),
            "lora_build_ms": (0.0, "not measured per layer (bench arm staged-prerouter-lora "
                              "measures the adapter's decode cost)")}


def model_toml(values: dict[str, tuple[Any, str]], name: str, header: list[str]) -> str:
    from sim.profile_toml import toml_text

    order = tuple(k for k in MODEL_KEYS if k in values)
    desc = (f"{name}: {values['layers'][0]} layers x {values['experts'][0]} experts, "
            f"K={values['k'][0]}, bundle {values['bundle_bytes'][0]} bytes (from its manifest)")
    return toml_text(header, values, order, desc)


def write_model(path: Path, text: str) -> Path:
    """Write atomically after checking that load_model accepts it."""
    from sim.profiles import load_model, write_checked

    return write_checked(path, text, load_model)
