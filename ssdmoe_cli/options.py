"""Command-line options that several commands share, declared once (typer Annotated types)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ReadMbps = Annotated[str | None, typer.Option(
    "--read-mbps", help="Throttle reads from the model's disk to N MB/s (the kernel's block-I/O "
    "throttle; Linux, root).")]
ReadIops = Annotated[str | None, typer.Option(
    "--read-iops", help="Throttle reads from the model's disk to N reads per second.")]
MemLimit = Annotated[str | None, typer.Option(
    "--mem-limit", help="Emulate a machine whose RAM leaves this much to the process and its "
    "page cache together: 700M, 1.5G (the kernel's memory control group; Linux, root).")]
Cpus = Annotated[int | None, typer.Option(
    "--cpus", help="Run on N cores only (the kernel's cpuset; Linux, root).")]
CpuQuota = Annotated[str | None, typer.Option(
    "--cpu-quota", help="CPU time in cores' worth per 100 ms, e.g. 0.5 (the kernel's CFS "
    "bandwidth control; Linux, root).")]
Temp = Annotated[float, typer.Option(
    "--temp", help="Sampling temperature (default 1.0: realistic routing; 0 = greedy, whose "
    "tiny-fixture text loops).")]
Seed = Annotated[int, typer.Option("--seed", help="Sampling seed.")]
LoraDir = Annotated[Path | None, typer.Option(
    "--lora", help="Recovery LoRA adapter (ssdmoe train sft/distill), unmerged on the resident "
    "projections. Default: with --prerouter, MODEL/lora/k{K}-distill (else k{K}-sft) when "
    "trained for those heads.")]
NoLora = Annotated[bool, typer.Option("--no-lora", help="Serve without any adapter.")]
Readers = Annotated[int | None, typer.Option(
    "--readers", help="Reads in flight (reader threads), 1-64. Default: the model directory's "
    "queue_depth.json (ssdmoe calibrate --queue-depth-only --model DIR), else 2.")]
NativeReads = Annotated[bool, typer.Option(
    "--native-reads/--no-native-reads", help="Queued bundle reads on native threads that never "
    "wait for Python's interpreter lock (engine.native_reads; built with the system's C "
    "compiler on first use; without one, Python reader threads, run.json says why). Default: "
    "Python reader threads.")]
CachePolicy = Annotated[str | None, typer.Option(
    "--cache-policy", help="Eviction policy of the app caches (hot pool, staged slots, "
    "page-cache budget): lru (default), lfu, least-stale, fifo (contract.eviction; belady is "
    "the simulator's).")]

HotMb = Annotated[float | None, typer.Option(
    "--hot-mb", help="The hot path's LRU of expert bundles in MiB (--preset hot; default "
    "25% of the expert bytes). Under --mem-limit it takes from the page cache.")]
FirstLayerHint = Annotated[bool, typer.Option(
    "--first-layer-hint", help="With --prerouter: start reading the first MoE layer's likely "
    "experts from each step's token, before its router (the table `train heads` fits).")]
Lead = Annotated[str, typer.Option(
    "--lead", help="How far ahead staged experts are known: none (on demand), token "
    "(prerouter heads, one token ahead; implied by --prerouter), layer (same token, the "
    "next layer's router on this layer's state; preset staged).")]
StagedHeadroom = Annotated[int | None, typer.Option(
    "--staged-headroom", help="Staged slots per layer beyond K (--preset staged; default K: "
    "room to stage the next call's set while the last call's is in use).")]


def check_engine_options(hot_mb: float | None, staged_headroom: int | None) -> None:
    from contract.errors import BadInput

    if hot_mb is not None and not hot_mb > 0:
        raise BadInput(f"--hot-mb: must be > 0, got {hot_mb}")
    if staged_headroom is not None and staged_headroom < 0:
        raise BadInput(f"--staged-headroom: must be >= 0, got {staged_headroom}")


def served_lora(model: Path, lora: Path | None, no_lora: bool, prerouter: Path | None,
                top_k: int | None = None) -> str | None:
    """The adapter a command serves: --lora DIR, none with --no-lora, else the newest phase
    trained for the heads in use (the paper ships heads and LoRA together)."""
    from contract.errors import BadInput

    if lora is not None and no_lora:
        raise BadInput("--lora and --no-lora exclude each other")
    if no_lora:
        return None
    if lora is not None:
        return str(lora)
    if prerouter is None:
        return None
    from engine.lora import read_provenance
    from engine.manifest import read_manifest, sha256_file
    from engine.prerouter import WEIGHTS

    k = top_k if top_k is not None else read_manifest(model).top_k
    heads = Path(prerouter) / WEIGHTS
    if not heads.is_file():
        return None  # loading the heads reports it
    sha = sha256_file(heads)
    for phase in ("distill", "sft"):
        d = Path(model) / "lora" / f"k{k}-{phase}"
        prov = read_provenance(d)
        if prov is not None and prov.get("heads_sha256") == sha:
            typer.echo(f"lora: {d} (phase {phase}; --no-lora to serve without it)", err=True)
            return str(d)
    return None
