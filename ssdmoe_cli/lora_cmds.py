"""`ssdmoe lora merge-loss MODEL --lora DIR`: how much of the adapter survives merging into the
int4 base and re-quantizing (engine.train.merge_loss). MLX is imported inside the command body."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput

app = typer.Typer(help="Recovery LoRA adapters: merge loss.", no_args_is_help=True)


@app.command("merge-loss")
def merge_loss(
    model: Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")],
    lora: Annotated[Path, typer.Option("--lora", help="Adapter directory.")],
    prerouter: Annotated[Path | None, typer.Option(
        "--prerouter", help="Heads to route by (default: MODEL/prerouter for the adapter's K)."
    )] = None,
    windows: Annotated[int, typer.Option("--windows", help="Held-out windows of 128.")] = 16,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where reports go.")]
        = Path("reports/quality"),
) -> None:
    """Survival 1 - |U-M|/|U-B| (U unmerged, M merged and re-quantized, B base) per module
    kind at weight level, and at logit level on held-out text."""
    if windows < 1:
        raise BadInput(f"--windows: must be >= 1, got {windows}")
    from ssdmoe_cli.train_cmds import fast_blas, heads_dir

    fast_blas()
    import mlx.core as mx

    from engine import lora as adapters
    from engine.fixtures.train_loop import window_batches
    from engine.loader import load_resident, open_manifest, routed_at
    from engine.prerouter import Prerouter
    from engine.train import merge_loss as ml
    from engine.train.heads import corpus_tokens, forward_prerouted

    model = Path(model)
    spec, _ = adapters.read(lora)
    k = spec.provenance.get("top_k")
    manifest = routed_at(open_manifest(model, verify=False), k)
    top_k = None if k == manifest.native_top_k else k
    q = manifest.quantization
    heads = Path(prerouter) if prerouter is not None else heads_dir(model, top_k)
    pre = Prerouter.load_for(heads, manifest)

    def variant(merge: bool, base_only: bool):
        m, tok = load_resident(model, top_k=top_k, lora=lora)
        ml.quantize_bases(m, q["bits"], q["group_size"])
        if merge:
            ml.merge(m)
        if base_only:
            adapters.detach(m)
        return m, tok

    unmerged, tok = variant(False, False)
    merged, _ = variant(True, False)
    base, _ = variant(False, True)
    weights = ml.weight_survival(unmerged)
    _, held = corpus_tokens(tok, None)
    batches = [mx.array(b[:, :-1]) for b in window_batches(held, 128, windows, 8)]
    rows = sum(b.shape[0] for b in batches)
    logits = ml.logit_survival(unmerged, merged, base,
                               lambda m, x: forward_prerouted(m, pre, x), batches)
    served = "float" if manifest.resident_quantization is None else "quantized"
    from engine.manifest import MANIFEST_FILE, sha256_file

    sha = sha256_file(manifest.path(MANIFEST_FILE))
    lines = [f"# Merge loss: {lora} on {model}", "",
             f"`ssdmoe lora merge-loss {model} --lora {lora}` (model manifest sha {sha[:12]}); "
             "survival = 1 - |U-M|/|U-B|; "
             f"base int{q['bits']} group {q['group_size']} (resident projections served "
             f"{served}{', quantized first as an int4 deployment' if served == 'float' else ''})"
             f"; logits on {rows} held-out windows of 128, routed by {heads}.", "",
             "| module kind | modules | survival | delta RMS | int4 step RMS |",
             "|---|---|---|---|---|"]
    for kind, r in weights.items():
        surv = "n/a" if r["survival"] is None else f"{100 * r['survival']:.1f}%"
        lines.append(f"| {kind} | {r['modules']} | {surv} | {r['delta_rms']:.2e} | "
                     f"{r['step_rms']:.2e} |")
    lines += ["", f"Logit level: {100 * logits:.1f}% of the adapter's effect on the logits "
              "survives merging."]
    text = "\n".join(lines)
    typer.echo(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"merge-loss-{model.name}-{Path(lora).name}"
    report = {"model": str(model), "manifest_sha256": sha, "lora": str(lora),
              "provenance": spec.provenance,
              "bits": q["bits"], "group_size": q["group_size"], "served_resident": served,
              "weights": weights, "logit_survival": logits, "windows": rows}
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(text + "\n")
    typer.echo(f"wrote {out_dir / stem}.json and .md", err=True)
