"""Load a converted model for streaming: the mlx-lm model built from the manifest's config, the
resident part loaded, and a `StreamingMoE` installed on every MoE layer reading from an
`ExpertStore`. Also `load_resident`: the same numbers with every expert in memory, as a plain
mlx-lm model (the reference for exactness tests and the resident baseline for benchmarks).

On MLX's CPU backend float resident tensors are upcast to float32 (bf16 is 6-8x slower there);
on Metal and CUDA they keep the checkpoint's dtype (engine.device)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from contract import eviction
from contract.engine_config import EngineConfig
from contract.errors import BadInput
from engine.archs import ARCHS, routing_spec
from engine.convert import build_skeleton, moe_layers, quantize_like_source, switch_glu_of
from engine.device import upcasts
from engine.engine import Engine
from engine.layer_file import stacked_experts
from engine.manifest import (
    CONFIG_FILE,
    PROJECTIONS,
    RESIDENT_FILE,
    Manifest,
    expert_tensor_names,
    read_manifest,
    verify_files,
)
from engine.moe import RoutingCallback, StreamingMoE
from engine.paths.kernel import ExpertPath
from engine.safetensors_io import read_safetensors_header
from engine.store import ExpertStore, LoadCallback

PathFactory = Callable[[ExpertStore, int], ExpertPath]


def open_manifest(converted_dir: Path, verify: bool | None = None) -> Manifest:
    """Read the manifest and check the files: sizes always, sha256 per `verify` (None: files
    up to 256 MiB, True: all, False: none). Raises BadInput naming the file."""
    manifest = read_manifest(Path(converted_dir))
    if manifest.model_type not in ARCHS:
        raise BadInput(f"{manifest.path('manifest.json')}: unsupported architecture "
                       f"{manifest.model_type!r} (supported: {', '.join(ARCHS)})")
    verify_files(manifest, full_hash=verify)
    return manifest


def _resident_weights(manifest: Manifest, upcast: bool) -> dict:
    """resident.safetensors, float tensors as float32 when `upcast`."""
    import mlx.core as mx

    dtype = mx.float32 if upcast else None
    path = manifest.path(RESIDENT_FILE)
    read_safetensors_header(path)
    try:
        weights = mx.load(str(path))
    except Exception as err:  # noqa: BLE001
        raise BadInput(f"{path}: cannot read ({err})") from None
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    return weights


def _model(manifest: Manifest, weights: dict):
    model = build_skeleton(manifest.config, manifest.path(CONFIG_FILE))
    if manifest.resident_quantization:
        quantize_like_source(model, manifest.resident_quantization, weights)
    layers = moe_layers(model, manifest.model_type)
    if sorted(layers) != manifest.moe_layers:
        raise BadInput(f"{manifest.path('manifest.json')}: config does not match tensors: config "
                       f"has MoE layers {sorted(layers)}, manifest {manifest.moe_layers}")
    q = manifest.quantization
    for i in layers:
        sm = switch_glu_of(model, manifest.model_type, i)
        entry = manifest.layers[i]
        names = expert_tensor_names(q.get("mode", "affine") == "affine", "bias" in sm.gate_proj)
        if entry.names != names:
            raise BadInput(f"{manifest.path(entry.file)}: config does not match tensors: the "
                           f"file holds {', '.join(entry.names)}; config gives "
                           f"{', '.join(names)}")
        for proj in PROJECTIONS:
            lin = getattr(sm, proj)
            e, out_dim, in_dim = lin.num_experts, lin.output_dims, lin.input_dims
            groups = in_dim // q["group_size"]
            want = {"weight": [e, out_dim, in_dim * q["bits"] // 32],
                    "scales": [e, out_dim, groups], "biases": [e, out_dim, groups],
                    "bias": [e, out_dim]}
            for part, shape in want.items():
                name = f"{proj}.{part}"
                if name in entry.tensors and entry.tensors[name].shape != shape:
                    raise BadInput(f"{manifest.path(entry.file)}: config does not match "
                                   f"tensors: {name} is {entry.tensors[name].shape}, config "
                                   f"gives {shape}")
    return model, layers


def _load_weights(model, weights: dict, manifest: Manifest) -> None:
    import mlx.core as mx

    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        msg = " ".join(str(err).split())
        raise BadInput(f"{manifest.path(RESIDENT_FILE)}: config does not match tensors "
                       f"({msg[:300]})") from None
    try:
        mx.eval(model.parameters())
    except Exception as err:  # noqa: BLE001
        raise BadInput(f"{manifest.path(RESIDENT_FILE)}: cannot read ({err})") from None
    model.eval()


def load_tokenizer(manifest: Manifest):
    import transformers
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    transformers.logging.set_verbosity_error()
    try:
        return mlx_load_tokenizer(manifest.root, eos_token_ids=manifest.config.get("eos_token_id"))
    except Exception as err:  # noqa: BLE001
        raise BadInput(f"{manifest.root}: cannot load the tokenizer "
                       f"({type(err).__name__}: {err})") from None


def load_streaming(
    converted_dir: Path,
    *,
    o_direct: bool = False,
    page_cache_budget: int | None = None,
    verify: bool | None = None,
    on_load: LoadCallback | None = None,
    on_routing: RoutingCallback | None = None,
    path_factory: PathFactory | None = None,
    prefill_path_factory: PathFactory | None = None,
    float32: bool | None = None,
    config: EngineConfig | None = None,
):
    """-> an Engine (engine.engine): the model is an ordinary mlx-lm model (use it with
    mlx_lm.generate_step or engine.generate) whose MoE blocks are `StreamingMoE`s reading
    experts through the Engine's store. `config` (an EngineConfig, e.g. `EngineConfig.from_preset(
    "staged")`) chooses each layer's path per phase and sets o_direct / page_cache_budget
    (the keyword arguments are used when no config is given: preset "on-demand").
    `path_factory(store, layer)` / `prefill_path_factory` override the config's paths.
    The shared runtime (config, readers, counters, paths) is `engine.runtime`. `float32`:
    upcast float tensors (None: per the config's `dtype`, engine.device)."""
    from engine.runtime import build_runtime

    if config is None:
        config = EngineConfig.from_preset("on-demand", o_direct=o_direct,
                                          page_cache_budget=page_cache_budget)
    manifest = routed_at(open_manifest(converted_dir, verify), config.top_k)
    config.validate(manifest)
    weights = _resident_weights(manifest, upcasts(config.dtype) if float32 is None else float32)
    model, layers = _model(manifest, weights)
    store = ExpertStore(manifest, o_direct=config.o_direct,
                        page_cache_budget=config.page_cache_budget, on_load=on_load,
                        cache_policy=config.cache_policy or eviction.DEFAULT)
    rt = build_runtime(config, store)
    arch = ARCHS[manifest.model_type]
    spec = routing_spec(manifest.config)
    for i in layers:
        layer = model.layers[i]
        path = path_factory(store, i) if path_factory else rt.path(i, "decode")
        if prefill_path_factory:
            prefill = prefill_path_factory(store, i)
        elif path_factory:
            prefill = None
        else:
            prefill = rt.path(i, "prefill")
        block = StreamingMoE(i, getattr(layer, arch.moe_attr), arch, spec, path,
                             None if prefill is path else prefill, on_routing)
        setattr(layer, arch.moe_attr, block)
    _load_weights(model, weights, manifest)
    if config.lora is not None:
        rt.lora = install_lora(model, Path(config.lora), manifest)
    if config.prerouter is not None:
        from engine.prerouter import Prerouter, install

        pre = Prerouter.load_for(Path(config.prerouter), manifest)
        blocks = streaming_blocks(model)
        rt.preroute = install(blocks, pre)
        if config.first_layer_hint:
            install_hint(blocks, pre, Path(config.prerouter))
    elif config.lead_kind == "layer":
        from engine import layer_lead

        blocks = streaming_blocks(model)
        if not any(n + 1 in blocks for n in blocks):
            raise BadInput(f"{manifest.root}: lead 'layer' needs a MoE layer followed by a MoE "
                           f"layer (MoE layers: {manifest.moe_layers})")
        rt.preroute = layer_lead.install(blocks)
    return Engine(model, load_tokenizer(manifest), store, rt)


def install_hint(blocks: dict, pre, src: Path) -> None:
    """The first MoE layer's token table on its staged decode path (engine.first_layer_hint)."""
    from engine.first_layer_hint import HINT_FILE
    from engine.paths.staged import StagedPath

    if pre.hint is None:
        raise BadInput(f"{src / HINT_FILE}: no such file (first-layer hint: heads trained "
                       "before it existed; fit it with `ssdmoe train hint`)")
    first = blocks[min(blocks)].path
    if not isinstance(first, StagedPath):
        raise BadInput(f"first-layer hint: the first MoE layer's decode path is "
                       f"{first.name!r}; the hint fills the staged path's slots")
    first.hint = pre.hint


def install_lora(model, src: Path, manifest: Manifest):
    """Apply the adapter in `src` to a loaded model, refusing one trained on another base or K.
    -> engine.lora.Installed."""
    from engine import lora
    from engine.manifest import MANIFEST_FILE, sha256_file

    return lora.install(model, src, sha256_file(manifest.path(MANIFEST_FILE)), manifest.top_k)


def routed_at(manifest: Manifest, k: int | None) -> Manifest:
    """The manifest as the engine sees it when routing at `k` experts per token instead of the
    model's own K (None: unchanged). `native_top_k` keeps the model's K for the trace."""
    import dataclasses

    native = manifest.top_k
    if k is not None and k != native:
        if k > manifest.num_experts:
            raise BadInput(f"--top-k {k}: larger than the model's {manifest.num_experts} "
                           "experts")
        manifest = dataclasses.replace(manifest, top_k=k,
                                       config={**manifest.config, "num_experts_per_tok": k})
    manifest.native_top_k = native
    return manifest


def streaming_blocks(model) -> dict[int, StreamingMoE]:
    """{layer: block} of the installed streaming MoE blocks (to swap paths or callbacks)."""
    out = {}
    for i, layer in enumerate(model.layers):
        for child in layer.children().values():
            if isinstance(child, StreamingMoE):
                out[i] = child
    return out


def load_resident(converted_dir: Path, *, verify: bool | None = None,
                  float32: bool | None = None, top_k: int | None = None,
                  lora: Path | None = None):
    """-> (model, tokenizer): plain mlx-lm model with all experts in memory, quantized exactly
    as stored (QuantizedSwitchLinear), same resident numbers as `load_streaming` (routing at
    `top_k` experts per token when given), with the adapter `lora` applied when given."""
    import mlx.nn as nn

    manifest = routed_at(open_manifest(converted_dir, verify), top_k)
    weights = _resident_weights(manifest, upcasts() if float32 is None else float32)
    model, layers = _model(manifest, weights)
    q = manifest.quantization
    prefixes = tuple(f"{p}." for p in layers.values())
    nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                class_predicate=lambda p, m: (p + ".").startswith(prefixes)
                and hasattr(m, "to_quantized"))
    for i, prefix in layers.items():
        for name, v in stacked_experts(manifest, i).items():
            weights[f"{prefix}.{name}"] = v
    _load_weights(model, weights, manifest)
    if lora is not None:
        install_lora(model, Path(lora), manifest)
    return model, load_tokenizer(manifest)
