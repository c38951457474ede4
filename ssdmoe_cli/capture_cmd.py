"""`ssdmoe capture MODEL --out DIR`: run a fixed prompt set (each prompt: prefill + decode)
through the streaming engine and record one trace. `--overhead` instead measures what tracing
costs (recorder on vs off, same process) and writes a JSON report. MLX is imported inside the
command body only."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput
from ssdmoe_cli.options import (
    CachePolicy,
    CpuQuota,
    Cpus,
    FirstLayerHint,
    HotMb,
    Lead,
    LoraDir,
    MemLimit,
    NativeReads,
    NoLora,
    Readers,
    ReadIops,
    ReadMbps,
    Seed,
    StagedHeadroom,
    Temp,
    check_engine_options,
    served_lora,
)
from traces.regime import DECODE_SEED, DECODE_TEMP

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "traces" / "prompts" / "default.jsonl"
REPORT_DIR = Path("reports") / "trace-overhead"


def register(app: typer.Typer) -> None:
    app.command("capture")(capture)


def _sigterm_as_interrupt() -> None:
    """SIGTERM ends the run like Ctrl-C: the trace keeps what was captured (complete=false)."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def capture(
    model: Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="Trace directory to write (must be new or empty; see --force).")] = None,
    prompts: Annotated[Path, typer.Option(
        "--prompts", help='JSON-lines file, one {"prompt": ...} per line.')] = DEFAULT_PROMPTS,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", help="Tokens generated per prompt.")] = 64,
    preset: Annotated[str, typer.Option(
        "--preset", help="Engine preset: on-demand (exact), hot, staged.")] = "on-demand",
    prerouter: Annotated[Path | None, typer.Option(
        "--prerouter", help="Prerouter heads directory (ssdmoe train heads): their predictions "
        "are the decode routing of the layers after a head.")] = None,
    page_cache_mb: Annotated[float | None, typer.Option(
        "--page-cache-mb", help="Keep expert bytes in the page cache within this budget.")] = None,
    page_cache_fraction: Annotated[float | None, typer.Option(
        "--page-cache-fraction",
        help="Page-cache budget as a fraction of the model's expert bytes.")] = None,
    o_direct: Annotated[bool, typer.Option(
        "--o-direct", help="Read experts with O_DIRECT (bypasses the page cache).")] = False,
    lead: Lead = "none",
    first_layer_hint: FirstLayerHint = False,
    top_k: Annotated[int | None, typer.Option(
        "--top-k", help="Route at K experts per token instead of the model's own K.")] = None,
    lora: LoraDir = None,
    no_lora: NoLora = False,
    read_mbps: ReadMbps = None,
    read_iops: ReadIops = None,
    mem_limit: MemLimit = None,
    cpus: Cpus = None,
    cpu_quota: CpuQuota = None,
    temp: Temp = DECODE_TEMP,
    greedy: Annotated[bool, typer.Option(
        "--greedy", help="Greedy decoding (same as --temp 0; tiny fixtures' greedy text loops, "
        "so its routing repeats).")] = False,
    seed: Seed = DECODE_SEED,
    prefill_step_size: Annotated[int, typer.Option(
        "--prefill-step-size", help="Prompt tokens per prefill step.")] = 2048,
    stop_at_eos: Annotated[bool, typer.Option(
        "--stop-at-eos/--no-stop-at-eos",
        help="Stop a prompt at EOS (default: always decode --max-tokens).")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing trace in --out.")] = False,
    progress: Annotated[bool, typer.Option(
        "--progress/--no-progress", help="Show a progress bar on stderr.")] = True,
    lookahead: Annotated[bool, typer.Option(
        "--lookahead/--no-lookahead", help="Build step t+1's graph while step t computes "
        "(with hot/staged decode; exact decode never looks ahead).")] = True,
    verify: Annotated[bool | None, typer.Option(
        "--verify/--no-verify",
        help="sha256 every file (default: files up to 256 MiB; sizes always).")] = None,
    overhead: Annotated[bool, typer.Option(
        "--overhead", help="Measure tracing overhead (recorder on vs off) instead of "
        "capturing; writes JSON under reports/trace-overhead/.")] = False,
    rounds: Annotated[int, typer.Option("--rounds", help="--overhead: measured rounds.")] = 5,
    readers: Readers = None,
    native_reads: NativeReads = False,
    cache_policy: CachePolicy = None,
    hot_mb: HotMb = None,
    staged_headroom: StagedHeadroom = None,
    report: Annotated[Path | None, typer.Option(
        "--report", help="--overhead: JSON output path "
        "(default reports/trace-overhead/<model>.json).")] = None,
) -> None:
    """Record a trace: every prompt of --prompts, each prefill + --max-tokens decode steps,
    `request` = prompt index (or, with --overhead, measure what tracing costs)."""
    if max_tokens < 1:
        raise BadInput(f"--max-tokens: must be >= 1, got {max_tokens}")
    if temp < 0:
        raise BadInput(f"--temp: must be >= 0, got {temp}")
    if prefill_step_size < 1:
        raise BadInput(f"--prefill-step-size: must be >= 1, got {prefill_step_size}")
    if page_cache_mb is not None and page_cache_fraction is not None:
        raise BadInput("--page-cache-mb and --page-cache-fraction: give one, not both")
    if page_cache_mb is not None and page_cache_mb <= 0:
        raise BadInput(f"--page-cache-mb: must be > 0, got {page_cache_mb}")
    if page_cache_fraction is not None and not 0 < page_cache_fraction <= 1:
        raise BadInput(f"--page-cache-fraction: must be in (0, 1], got {page_cache_fraction}")
    if rounds < 1:
        raise BadInput(f"--rounds: must be >= 1, got {rounds}")
    check_engine_options(hot_mb, staged_headroom)
    if not overhead and out is None:
        raise BadInput("--out: required (the trace directory to write)")
    if greedy:
        temp = 0.0
    from engine.machine_limits import (
        EmulatedMachine,
        MachineLimits,
        anonymous_bytes,
        check_available,
    )

    limits = MachineLimits.parse(mem_limit, cpus, cpu_quota, read_mbps, read_iops)
    check_available(limits)
    if not (model / "manifest.json").is_file():
        raise BadInput(f"{model}: not a converted model (no manifest.json; ssdmoe convert)")

    from engine.capture import capture as run_capture
    from engine.capture import load_engine, prepare_out_dir, read_prompts, start_recorder
    from traces.regime import decode_routing

    texts = read_prompts(prompts)
    engine = load_engine(
        model, preset=preset, o_direct=o_direct, page_cache_mb=page_cache_mb,
        page_cache_fraction=page_cache_fraction, verify=verify, lookahead=lookahead,
        prerouter=prerouter, lead=lead, top_k=top_k, readers=readers, hot_mb=hot_mb,
        staged_headroom=staged_headroom, cache_policy=cache_policy,
        first_layer_hint=first_layer_hint, native_reads=native_reads,
        lora=served_lora(model, lora, no_lora, prerouter, top_k))
    # the emulated machine starts once the model is loaded (as the throttle always did: loading
    # is not what is measured), and before --out is touched: a refused limit loses nothing
    machine = EmulatedMachine(model, limits)
    own_after_load = anonymous_bytes()  # what a memory limit must leave room for (run.json)
    try:
        machine.__enter__()
        if out is not None and not overhead:
            out = prepare_out_dir(out, force)
    except BaseException:
        machine.leave()
        engine.close()
        raise
    for n, text in enumerate(texts, 1):
        if not engine.tokenizer.encode(text):
            raise BadInput(f"{prompts}:{n}: prompt encodes to no tokens")
    try:
        if overhead:
            _overhead(model, engine, texts, max_tokens, rounds, report, progress)
            return
        _sigterm_as_interrupt()
        extra = {"capture": {"prompts_file": str(prompts), "prompts": len(texts),
                             "max_tokens": max_tokens, "temp": temp, "seed": seed,
                             "decode_routing": decode_routing(temp, seed),
                             "prefill_step_size": prefill_step_size,
                             "stop_at_eos": stop_at_eos},
                 "throttle": machine.throttle_record(), "machine": machine.record(),
                 "process": {"own_bytes_after_load": own_after_load}}
        rec = start_recorder(out, engine, extra=extra)
        with rec, _progress(progress, len(texts) * max(max_tokens - 1, 1)) as bar:
            results = run_capture(engine, texts, max_tokens, recorder=rec,
                                  temp=temp, seed=seed,
                                  prefill_step_size=prefill_step_size,
                                  stop_at_eos=stop_at_eos, on_step=bar)
            extra["process"]["own_bytes_at_exit"] = anonymous_bytes()
            if extra["machine"] and "memory" in extra["machine"]:
                extra["machine"]["memory"].update(machine.exit_figures())
    finally:
        machine.leave()
        engine.close()
    from engine.capture import decode_tok_s

    prefill_tokens = sum(r.prompt_tokens for r in results)
    prefill_s = sum(r.prefill_s for r in results)
    typer.echo(f"trace {out}: {rec.steps} steps, {len(results)} requests, decode "
               f"{decode_tok_s(results):.1f} tok/s, prefill "
               f"{prefill_tokens / prefill_s if prefill_s else 0:.1f} tok/s "
               f"(ssdmoe trace summary {out})")


class _progress:
    """A rich progress bar on stderr advanced by decode steps; a no-op when disabled."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled and sys.stderr.isatty(), total
        self.bar = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("capturing", total=self.total)
        return self

    def __call__(self, row: dict) -> None:
        if self.bar is not None and row["phase"] == "decode":
            self.bar.update(self.task, advance=1,
                            description=f"capturing (prompt {row['request'] + 1})")

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def _span(span) -> str:
    return "n/a" if not span else f"{span[0]:.1f}..{span[1]:.1f}%"


def _overhead(model_dir, engine, texts, max_tokens, rounds, report, progress):
    from rich.console import Console
    from rich.table import Table

    from engine.bench.trace_overhead import measure_overhead
    from traces.run_info import machine_info, package_versions

    err = Console(stderr=True)

    def show(row: dict) -> None:
        if progress:
            err.print(f"round {row['round']} {row['arm']:>3}: {row['decode_tok_s']:.2f} tok/s")

    result = measure_overhead(engine, texts, max_tokens, rounds, on_run=show)
    from engine.manifest import MANIFEST_FILE, sha256_file

    result.update(model=str(model_dir),
                  manifest_sha256=sha256_file(Path(model_dir) / MANIFEST_FILE),
                  command=list(sys.argv),
                  machine=machine_info(model_dir), packages=package_versions())
    table = Table(title=f"tracing overhead: {model_dir} ({len(texts)} prompts x {max_tokens} "
                        f"tokens, {rounds} rounds)")
    for col in ("arm", "median decode tok/s", "rounds (tok/s)"):
        table.add_column(col, justify="right")
    for arm in ("off", "on"):
        runs = [f"{r['decode_tok_s']:.1f}" for r in result["runs"] if r["arm"] == arm]
        table.add_row(arm, f"{result['median_decode_tok_s'][arm]:.2f}", " ".join(runs))
    Console().print(table)
    typer.echo(f"overhead: {result['overhead_pct']:.2f}% of decode tok/s (median off vs on), "
               f"{result['paired_overhead_pct']:.2f}% paired (median over back-to-back "
               f"prompt pairs; pairs p10..p90 {_span(result['paired_overhead_p10_p90'])}); "
               f"recorder's own time {result['recorder_ms_per_step']:.3f} "
               f"ms/step = {result['recorder_pct_of_step']:.2f}% of a traced step")
    path = report or REPORT_DIR / f"{Path(model_dir).resolve().name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    typer.echo(f"wrote {path}")
