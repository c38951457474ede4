"""`ssdmoe train heads MODEL`: training phase 1 (prerouter head distillation) on a converted
model. MLX is imported inside the command body only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput
from ssdmoe_cli.atomic_dir import build_into

app = typer.Typer(help="Train the prerouter (phase 1: heads).", no_args_is_help=True)


@app.command("heads")
def heads(
    model: Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="Prerouter directory to write (default: MODEL/prerouter).")] = None,
    text: Annotated[Path | None, typer.Option(
        "--text", help="UTF-8 training text (default: the fixtures' Python-stdlib corpus).")]
        = None,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 600,
    hidden: Annotated[int, typer.Option("--hidden", help="Head width.")] = 128,
    train_windows: Annotated[int, typer.Option(
        "--train-windows", help="Windows of 128 tokens recorded for training.")] = 256,
    eval_windows: Annotated[int, typer.Option(
        "--eval-windows", help="Held-out windows for the report.")] = 64,
    seed: Annotated[int, typer.Option("--seed", help="Seed (head init, batches).")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out.")] = False,
) -> None:
    """Distill one prerouter head per MoE layer that has a MoE layer after it, from the
    served (int4) model; prints held-out recall against the reuse and warm-start baselines
    and writes MODEL/prerouter (use it with `--prerouter` / EngineConfig.prerouter)."""
    for name, v in (("--steps", steps), ("--hidden", hidden), ("--train-windows", train_windows),
                    ("--eval-windows", eval_windows)):
        if v < 1:
            raise BadInput(f"{name}: must be >= 1, got {v}")
    if text is not None and not text.is_file():
        raise BadInput(f"--text {text}: no such file")
    out = Path(out) if out is not None else Path(model) / "prerouter"
    if out.exists() and not force:
        raise BadInput(f"{out}: already exists (use --force to replace it)")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from engine.loader import load_resident
    from engine.train_heads import HeadsConfig, corpus_tokens, train_heads

    lm, tokenizer = load_resident(model)
    if not all(hasattr(layer, "mlp") and hasattr(layer.mlp, "gate")
               for layer in lm.model.layers):
        raise BadInput(f"{model}: head training supports qwen3_moe-style models (every layer "
                       "a MoE block `mlp` with a `gate` router)")
    train_ids, held_ids = corpus_tokens(tokenizer, text)
    cfg = HeadsConfig(hidden=hidden, steps=steps, train_windows=train_windows,
                      eval_windows=eval_windows, seed=seed)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[loss]}"), console=Console(stderr=True))
    with bar:
        task = bar.add_task("heads (recording first)", total=steps, loss="")

        def advance(step: int, loss: float) -> None:
            bar.update(task, completed=step, description="heads", loss=f"kl {loss:.3f}")

        try:
            pre = train_heads(lm, train_ids, held_ids, cfg, progress=advance)
        except ValueError as err:
            raise BadInput(f"{text or 'corpus'}: {err}") from None
    build_into(out, out.with_name(out.name + ".partial"), pre.save)
    rep = pre.spec.report
    typer.echo(f"{'head':>8} {'recall':>7} {'reuse':>7} {'warm':>7}  (held-out recall of the "
               "next token's top-K)")
    for r in rep["heldout"]["per_head"]:
        typer.echo(f"{r['owner']:>3}->{r['consumer']:<3} {r['head_recall']:7.3f} "
                   f"{r['reuse_recall']:7.3f} {r['warm_start_recall']:7.3f}")
    h = rep["heldout"]
    typer.echo(f"{'mean':>8} {h['head_recall_mean']:7.3f} {h['reuse_recall_mean']:7.3f} "
               f"{h['warm_start_recall_mean']:7.3f}")
    q = rep["lm_heldout"]
    typer.echo(f"held-out cross-entropy: own routing {q['ce_base']:.3f}, predicted routing "
               f"{q['ce_prerouted']:.3f}; greedy tokens agree {100 * q['greedy_agreement']:.1f}%"
               " (no recovery LoRA yet)")
    typer.echo(f"wrote {out} (record {rep['record_s']} s, train {rep['train_s']} s)")
    typer.echo(json.dumps({"out": str(out), "head_recall_mean": h["head_recall_mean"]}))
