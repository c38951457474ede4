"""`ssdmoe train heads|sft|distill MODEL`: the three training phases on a converted model
(heads: prerouter head distillation; sft: the recovery LoRA on the student path; distill:
on-policy distillation of that LoRA). MLX is imported inside the command bodies only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput
from ssdmoe_cli.atomic_dir import build_into

app = typer.Typer(help="Train the prerouter heads (phase 1) and the recovery LoRA (phases 2, 3).",
                  no_args_is_help=True)


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
    top_k: Annotated[int | None, typer.Option(
        "--top-k", help="Route at K experts per token instead of the model's own (heads for "
        "another K; default --out MODEL/prerouter-k{K}).")] = None,
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
    out = Path(out) if out is not None else heads_dir(Path(model), top_k)
    if out.exists() and not force:
        raise BadInput(f"{out}: already exists (use --force to replace it)")
    fast_blas()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from engine.loader import load_resident
    from engine.train.heads import HeadsConfig, corpus_tokens, train_heads

    lm, tokenizer = load_resident(model, top_k=top_k)
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
        task = bar.add_task("heads (recording first)", total=steps, loss="", rate="")

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
               " (before the recovery LoRA: ssdmoe train sft)")
    f = rep["first_layer_hint"]
    typer.echo(f"first MoE layer from the token (no head predicts it): held-out recall "
               f"{f['heldout_recall']:.3f}, the previous position's set "
               f"{f['previous_position_recall']:.3f}")
    typer.echo(f"wrote {out} (record {rep['record_s']} s, train {rep['train_s']} s)")
    typer.echo(json.dumps({"out": str(out), "head_recall_mean": h["head_recall_mean"]}))


@app.command("hint")
def hint(
    model: Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")],
    prerouter: Annotated[Path | None, typer.Option(
        "--prerouter", help="Prerouter directory to add it to (default: MODEL/prerouter).")]
        = None,
    text: Annotated[Path | None, typer.Option(
        "--text", help="UTF-8 training text (default: the fixtures' Python-stdlib corpus).")]
        = None,
    train_windows: Annotated[int, typer.Option(
        "--train-windows", help="Windows of 128 tokens recorded for the fit (one forward "
        "pass each: on a large model, fewer).")] = 256,
    eval_windows: Annotated[int, typer.Option(
        "--eval-windows", help="Held-out windows for the recall.")] = 64,
) -> None:
    """Fit the first MoE layer's token table (engine.first_layer_hint; `train heads` fits it
    too) into an existing prerouter directory, for heads trained before it existed."""
    from engine.first_layer_hint import HINT_FILE

    pre_dir = Path(prerouter) if prerouter is not None else Path(model) / "prerouter"
    meta = pre_dir / "prerouter.json"
    if not meta.is_file():
        raise BadInput(f"{meta}: no such file (train the heads first: ssdmoe train heads)")
    if text is not None and not text.is_file():
        raise BadInput(f"--text {text}: no such file")
    for name, v in (("--train-windows", train_windows), ("--eval-windows", eval_windows)):
        if v < 1:
            raise BadInput(f"{name}: must be >= 1, got {v}")
    fast_blas()
    from engine.loader import load_resident
    from engine.prerouter import Prerouter
    from engine.train.heads import HeadsConfig, corpus_tokens, train_first_layer_hint

    top_k = Prerouter.load(pre_dir).spec.top_k  # a bad description is one line, here
    spec = json.loads(meta.read_text())
    lm, tokenizer = load_resident(model, top_k=top_k)
    train_ids, held_ids = corpus_tokens(tokenizer, text)
    try:
        table, report = train_first_layer_hint(
            lm, train_ids, held_ids,
            HeadsConfig(train_windows=train_windows, eval_windows=eval_windows))
    except ValueError as err:
        raise BadInput(f"{text or 'corpus'}: {err}") from None
    table.save(pre_dir)
    spec.setdefault("report", {})["first_layer_hint"] = report
    meta.write_text(json.dumps(spec, indent=1) + "\n")
    typer.echo(f"wrote {pre_dir / HINT_FILE}: held-out recall {report['heldout_recall']:.3f} "
               f"(the previous position's set {report['previous_position_recall']:.3f})")


def fast_blas() -> None:
    """Training is matmul-bound: on Linux re-run this command once with OpenBLAS preloaded."""
    from engine.blas import reexec_with_fast_blas

    reexec_with_fast_blas()


def heads_dir(model: Path, top_k: int | None) -> Path:
    """The default heads directory: MODEL/prerouter, or MODEL/prerouter-k{K} for another K."""
    from engine.manifest import read_manifest

    if top_k is None or top_k == read_manifest(model).top_k:
        return model / "prerouter"
    return model / f"prerouter-k{top_k}"


def teacher_dir(model: Path) -> Path:
    """The unquantized model the conversion came from (manifest "source"), as recorded or
    relative to the model's parent directory."""
    from engine.manifest import read_manifest

    src = read_manifest(model).source
    if not src:
        raise BadInput(f"{model}: the manifest records no source model; give --teacher DIR")
    for cand in (Path(src), model.parent / Path(src).name):
        if (cand / "config.json").is_file():
            return cand
    raise BadInput(f"{model}: source model {src} not found; give --teacher DIR")


def _lora_phase(phase: str, model: Path, out: Path | None, prerouter: Path | None,
                teacher: Path | None, text: Path | None, top_k: int | None,
                init: Path | None, restart: bool, **cfg) -> None:
    fast_blas()
    from engine.fixtures.train_loop import progress_bar
    from engine.loader import open_manifest
    from engine.train.recovery_lora import LoraTrainConfig, default_out, run_phase

    model = Path(model)
    if text is not None and not text.is_file():
        raise BadInput(f"--text {text}: no such file")
    k = top_k if top_k is not None else open_manifest(model, verify=False).top_k
    config = LoraTrainConfig(phase=phase, **cfg)
    out = Path(out) if out is not None else default_out(model, phase, k)
    heads = Path(prerouter) if prerouter is not None else heads_dir(model, top_k)
    bar = progress_bar()
    task = bar.add_task(phase, total=config.steps, loss="", rate="")

    started = []

    def advance(stage: str, done: int, total: int, note: str) -> None:
        if not started:  # on the first report: inputs are checked by then, errors print alone
            bar.start()
            started.append(True)
        bar.update(task, description=stage, completed=done, loss=note)

    try:
        report = run_phase(model, config, heads,
                           Path(teacher) if teacher is not None else teacher_dir(model), out,
                           text=text, top_k=top_k, init_dir=init, restart=restart,
                           progress=advance)
    finally:
        if started:
            bar.stop()
    h = report["history"]
    typer.echo(f"{phase}: loss {h[0]['loss']:.3f} -> {h[-1]['loss']:.3f} over {config.steps} "
               f"steps, {report['rows']} rows ({report['trained_tokens']} tokens trained), "
               f"data {report['data_s']} s, train {report['train_s']} s"
               + (f" (resumed at step {report['resumed_at']})" if report["resumed_at"] else ""))
    typer.echo(f"wrote {out} (use it with --lora {out}; quality: ssdmoe eval {model})")
    typer.echo(json.dumps({"out": str(out), "phase": phase, "final_loss": h[-1]["loss"]}))


Out = Annotated[Path | None, typer.Option(
    "--out", help="Adapter directory to write (default: MODEL/lora/k{K}-{phase}).")]
Heads = Annotated[Path | None, typer.Option(
    "--prerouter", help="Prerouter heads the student routes by (default: MODEL/prerouter).")]
Teacher = Annotated[Path | None, typer.Option(
    "--teacher", help="Unquantized teacher model (default: the manifest's source model).")]
Text = Annotated[Path | None, typer.Option(
    "--text", help="UTF-8 text the prompts are drawn from (default: the fixtures' corpus).")]
TopK = Annotated[int | None, typer.Option(
    "--top-k", help="Route at K experts per token (an adapter for another K; heads trained "
    "at that K: ssdmoe train heads --top-k K).")]
Seed = Annotated[int, typer.Option("--seed", help="Seed (LoRA init, sampling, batches).")]
Restart = Annotated[bool, typer.Option(
    "--restart", help="Discard a checkpoint left in OUT.partial instead of resuming it.")]
Rank = Annotated[int, typer.Option("--rank", help="LoRA rank r.")]
Alpha = Annotated[float, typer.Option("--alpha", help="LoRA alpha (scale alpha/r).")]


@app.command("sft")
def sft(
    model: Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")],
    out: Out = None, prerouter: Heads = None, teacher: Teacher = None, text: Text = None,
    top_k: TopK = None, seed: Seed = 0, restart: Restart = False, rank: Rank = 16,
    alpha: Alpha = 32.0,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 200,
    sequences: Annotated[int, typer.Option(
        "--sequences", help="Teacher-sampled sequences of 129 tokens.")] = 1920,
    batch: Annotated[int, typer.Option("--batch", help="Sequences per step.")] = 8,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (cosine).")] = 1e-3,
) -> None:
    """Phase 2: train the recovery LoRA on the student path (routing by the heads'
    predictions, as served) on text the unquantized teacher samples. Needs the heads first.
    Resumes from OUT.partial when interrupted."""
    _lora_phase("sft", model, out, prerouter, teacher, text, top_k, None, restart, seed=seed,
                rank=rank, alpha=alpha, steps=steps, sequences=sequences, batch=batch, lr=lr)


@app.command("distill")
def distill(
    model: Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")],
    out: Out = None, prerouter: Heads = None, teacher: Teacher = None, text: Text = None,
    top_k: TopK = None, seed: Seed = 0, restart: Restart = False,
    init: Annotated[Path | None, typer.Option(
        "--from", help="Phase-2 adapter to start from (default: MODEL/lora/k{K}-sft).")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 60,
    sequences: Annotated[int, typer.Option(
        "--sequences", help="Student-sampled sequences of 129 tokens (a tenth of phase 2's "
        "1920).")] = 192,
    batch: Annotated[int, typer.Option("--batch", help="Sequences per step.")] = 8,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (cosine).")] = 5e-4,
    teacher_top_k: Annotated[int, typer.Option(
        "--teacher-top-k", help="Teacher tokens the reverse KL runs over (+ a tail).")] = 32,
) -> None:
    """Phase 3: on-policy distillation. The phase-2 student samples, the teacher scores; the
    loss is reverse KL over the teacher's top-k plus a tail term, on about a tenth of phase
    2's rows. Resumes from OUT.partial when interrupted."""
    _lora_phase("distill", model, out, prerouter, teacher, text, top_k, init, restart,
                seed=seed, steps=steps, sequences=sequences, batch=batch, lr=lr,
                teacher_top_k=teacher_top_k)
