"""`ssdmoe eval MODEL`: quality under predicted routing, and what each LoRA phase recovers
(engine.train.quality). Prints a table; writes JSON + Markdown under reports/quality/. MLX is
imported inside the command body only."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput

REPORTS = Path("reports/quality")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_model)


def eval_model(
    model: Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")],
    teacher: Annotated[Path | None, typer.Option(
        "--teacher", help="Unquantized teacher (default: the manifest's source model).")] = None,
    prerouter: Annotated[Path | None, typer.Option(
        "--prerouter", help="Heads (default: MODEL/prerouter, or MODEL/prerouter-k{K}).")] = None,
    lora: Annotated[list[Path] | None, typer.Option(
        "--lora", help="Adapter(s) to evaluate, one row each (default: MODEL/lora/k{K}-sft "
        "and k{K}-distill where present).")] = None,
    no_lora: Annotated[bool, typer.Option("--no-lora", help="No adapter rows.")] = False,
    top_k: Annotated[int | None, typer.Option(
        "--top-k", help="Route at K experts per token (heads and adapters for that K).")] = None,
    windows: Annotated[int, typer.Option("--windows", help="Held-out windows of 128.")] = 64,
    prompts: Annotated[int, typer.Option(
        "--prompts", help="Held-out prompts for greedy agreement.")] = 32,
    name: Annotated[str | None, typer.Option(
        "--name", help="Report name (default: MODEL's name and K).")] = None,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where reports go.")] = REPORTS,
) -> None:
    """Held-out perplexity, agreement with the teacher (greedy, top-1, top-5) and routing
    agreement for: the teacher, int4 with its own routers, int4 prerouted, and int4
    prerouted with each LoRA phase; plus the heads' recall@K and the share of the
    cross-entropy gap each adapter recovers."""
    if lora and no_lora:
        raise BadInput("--lora and --no-lora exclude each other")
    for opt, v in (("--windows", windows), ("--prompts", prompts)):
        if v < 1:
            raise BadInput(f"{opt}: must be >= 1, got {v}")
    from ssdmoe_cli.train_cmds import fast_blas, heads_dir, teacher_dir

    fast_blas()
    from engine.loader import load_resident, open_manifest, routed_at
    from engine.lora import read_provenance
    from engine.prerouter import Prerouter
    from engine.train import quality
    from engine.train.heads import corpus_tokens
    from engine.train.recovery_lora import default_out, load_teacher

    model = Path(model)
    manifest = routed_at(open_manifest(model, verify=False), top_k)
    k = manifest.top_k
    heads = Path(prerouter) if prerouter is not None else heads_dir(model, top_k)
    pre = Prerouter.load_for(heads, manifest)
    if lora is None and not no_lora:
        lora = [d for d in (default_out(model, p, k) for p in ("sft", "distill")) if d.is_dir()]
    base, tok = load_resident(model, top_k=top_k)
    t_dir = Path(teacher) if teacher is not None else teacher_dir(model)
    teacher_row = quality.Row("teacher (fp32)", load_teacher(t_dir, base))
    rows = [teacher_row, quality.Row("int4, own routers", base),
            quality.Row("int4 prerouted, no LoRA", base, pre)]
    for d in lora or []:
        m, _ = load_resident(model, top_k=top_k, lora=d)  # reads and checks the adapter
        prov = read_provenance(d) or {}
        rows.append(quality.Row(f"int4 prerouted + LoRA {prov.get('phase', d.name)}", m, pre,
                                {"dir": str(d), **prov}))
    _, held = corpus_tokens(tok, None)
    cfg = quality.EvalConfig(windows=windows, prompts=prompts)
    typer.echo(f"evaluating {len(rows)} rows on {windows} held-out windows of {cfg.seq_len} "
               f"tokens, K={k} ...", err=True)
    results = quality.evaluate(rows, teacher_row, held, cfg)
    recall = quality.heads_recall(base, pre, held, cfg)
    own, prerouted = rows[1].name, rows[2].name
    recovered = {r.name: quality.recovery(results, own, prerouted, r.name) for r in rows[3:]}
    from engine.manifest import MANIFEST_FILE, sha256_file

    report = {"model": str(model), "top_k": k, "heads": str(heads), "teacher": str(t_dir),
              "manifest_sha256": sha256_file(manifest.path(MANIFEST_FILE)),
              "config": cfg.__dict__, "rows": results, "heads_recall": recall,
              "gap_recovered": recovered,
              "command": "ssdmoe eval " + " ".join(sys.argv[2:])}
    text = quality.markdown(report)
    typer.echo(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = name or f"{model.name}-k{k}"
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(text + "\n")
    typer.echo(f"wrote {out_dir / stem}.json and .md", err=True)
