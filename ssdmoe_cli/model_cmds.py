"""`ssdmoe convert SRC DST` and `ssdmoe generate MODEL --prompt TEXT`. MLX is imported inside
the command bodies only."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput
from ssdmoe_cli.atomic_dir import build_into
from ssdmoe_cli.options import (
    CachePolicy,
    FirstLayerHint,
    LoraDir,
    NativeReads,
    NoLora,
    Readers,
    served_lora,
)


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)
    app.command("generate")(generate)


def convert(
    src: Annotated[Path, typer.Argument(help="mlx-lm MoE model directory (float or quantized).")],
    dst: Annotated[Path, typer.Argument(help="Output directory for the streaming layout.")],
    bits: Annotated[int | None, typer.Option(
        help="Expert bits (affine) for a float checkpoint [default: 4], or with --requantize."
    )] = None,
    group_size: Annotated[int | None, typer.Option(
        help="Expert group size for a float checkpoint [default: 64], or with --requantize."
    )] = None,
    requantize: Annotated[bool, typer.Option(
        "--requantize", help="Dequantize a quantized checkpoint's experts and quantize them "
        "again, affine at --bits/--group-size (changes the model; recorded in the manifest)."
    )] = False,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="Float scales and biases: auto (float32 when MLX runs on the CPU, else "
        "the checkpoint's), float32, or source.")] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing conversion.")] = False,
    layout: Annotated[str, typer.Option(
        "--layout", help="Expert layer files: bundled (each expert one contiguous range, read "
        "with one vectored read) or stacked (the version-1 layout, one tensor per name: an "
        "expert is as many reads as tensors; for before/after benchmarks).")] = "bundled",
) -> None:
    """Convert an mlx-lm MoE checkpoint (one file, or shards with their index) to the streaming
    layout: resident part + per-layer expert files (one contiguous range per expert) +
    manifest.json. Quantized experts keep the checkpoint's own quantization (affine, mxfp4,
    ...) unless --requantize."""
    from engine.convert import convert as run_convert
    from engine.device import upcasts
    from engine.manifest import MANIFEST_FILE

    src, dst = Path(src), Path(dst)
    if dst.exists():
        if not dst.is_dir():
            raise BadInput(f"{dst}: exists and is not a directory")
        if any(dst.iterdir()):
            if not (dst / MANIFEST_FILE).exists():
                raise BadInput(f"{dst}: directory is not empty and not a conversion; refusing")
            if not force:
                raise BadInput(f"{dst}: already holds a conversion (use --force to replace it)")
    if src.resolve() == dst.resolve():
        raise BadInput(f"{dst}: must differ from SRC")
    float32 = upcasts(dtype)
    manifest = build_into(dst, dst.with_name(dst.name + ".partial"), lambda tmp: run_convert(
        src, tmp, bits=bits, group_size=group_size, requantize=requantize, float32=float32,
        progress=lambda msg: typer.echo(msg, err=True), layout=layout))
    total = sum(e.size for e in manifest.files.values())
    q = manifest.quantization
    how = "requantized" if q["requantized"] else "as the checkpoint has them" \
        if manifest.resident_quantization else "quantized here"
    typer.echo(f"converted {src} -> {dst}: {manifest.model_type}, {len(manifest.layers)} MoE "
               f"layers x {manifest.num_experts} experts ({q['mode']} {q['bits']}-bit group "
               f"{q['group_size']}, {how}; {q['scales_dtype']} scales), "
               f"{manifest.bundle_bytes} bytes/bundle ({manifest.layout} layout), "
               f"{total / 2**20:.1f} MiB")


def generate(
    model: Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")],
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt text.")],
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 64,
    temp: Annotated[float, typer.Option("--temp", help="Sampling temperature; 0 = greedy.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    o_direct: Annotated[bool, typer.Option(
        "--o-direct", help="Read experts with O_DIRECT (bypasses the page cache).")] = False,
    page_cache_mb: Annotated[float | None, typer.Option(
        "--page-cache-mb", help="Keep expert bytes in the page cache within this budget.")] = None,
    verify: Annotated[bool | None, typer.Option(
        "--verify/--no-verify",
        help="sha256 every file (default: files up to 256 MiB; sizes always).")] = None,
    preset: Annotated[str, typer.Option(
        "--preset", help="Engine preset: on-demand (exact), hot, staged.")] = "on-demand",
    prerouter: Annotated[Path | None, typer.Option(
        "--prerouter", help="Prerouter heads directory (ssdmoe train heads): their predictions "
        "are the decode routing of the layers after a head.")] = None,
    first_layer_hint: FirstLayerHint = False,
    lora: LoraDir = None,
    no_lora: NoLora = False,
    top_k: Annotated[int | None, typer.Option(
        "--top-k", help="Route at K experts per token instead of the model's own K (heads "
        "and adapter trained for that K).")] = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="Record a trace (steps, routing, loads) into this new directory.")] = None,
    lookahead: Annotated[bool, typer.Option(
        "--lookahead/--no-lookahead", help="Build step t+1's graph while step t computes "
        "(with hot/staged decode; exact decode never looks ahead).")] = True,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing trace in the --trace directory.")] = False,
    readers: Readers = None,
    native_reads: NativeReads = False,
    cache_policy: CachePolicy = None,
) -> None:
    """Generate text from a converted model, streaming experts from disk (--preset picks the
    execution paths; every preset gives the same tokens)."""
    if max_tokens < 1:
        raise BadInput(f"--max-tokens: must be >= 1, got {max_tokens}")
    if temp < 0:
        raise BadInput(f"--temp: must be >= 0, got {temp}")
    if page_cache_mb is not None and page_cache_mb <= 0:
        raise BadInput(f"--page-cache-mb: must be > 0, got {page_cache_mb}")
    from contract.engine_config import EngineConfig
    from engine.loader import load_streaming

    if trace is not None:
        from engine.capture import prepare_out_dir, start_recorder

        trace = prepare_out_dir(trace, force, "--trace")
    budget = None if page_cache_mb is None else int(page_cache_mb * 2**20)
    config = EngineConfig.from_preset(preset, o_direct=o_direct, page_cache_budget=budget,
                                      lookahead=lookahead, top_k=top_k, readers=readers,
                                      cache_policy=cache_policy,
                                      prerouter=None if prerouter is None else str(prerouter),
                                      first_layer_hint=first_layer_hint,
                                      native_reads=native_reads,
                                      lora=served_lora(model, lora, no_lora, prerouter, top_k))
    engine = load_streaming(model, verify=verify, config=config)
    if not engine.tokenizer.encode(prompt):
        raise BadInput("--prompt: encodes to no tokens")

    def show(segment: str) -> None:
        sys.stdout.write(segment)
        sys.stdout.flush()

    rec = None if trace is None else start_recorder(trace, engine)
    try:
        result = engine.generate(prompt, max_tokens, temp=temp, seed=seed,
                                 on_text=None if json_out else show,
                                 **(rec.hooks() if rec is not None else {}))
    except BaseException:
        if rec is not None:
            rec.close(complete=False)  # keeps what was captured; run.json says incomplete
        raise
    finally:
        engine.close()
    if rec is not None:
        rec.close()
    if json_out:
        typer.echo(json.dumps(result.summary()))
        return
    sys.stdout.write("\n")
    typer.echo(f"[{result.prompt_tokens} prompt tokens, prefill {result.prefill_tok_s:.1f} tok/s,"
               f" {len(result.tokens)} tokens, decode {result.decode_tok_s:.1f} tok/s]", err=True)
