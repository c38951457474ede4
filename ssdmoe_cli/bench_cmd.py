"""`ssdmoe bench MODEL --arms resident,on-demand,hot,staged [--page-cache-budget BYTES]
[--rounds 3] [--json OUT]`: every arm on the same prompts, each in its own process, arm order
rotated per round, warm-up excluded; prints medians, writes JSON and a PNG under reports/bench/.
The engine is imported by the worker processes; this process only orchestrates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput
from ssdmoe_cli.options import (
    CachePolicy,
    CpuQuota,
    Cpus,
    LoraDir,
    MemLimit,
    NativeReads,
    NoLora,
    Readers,
    ReadIops,
    ReadMbps,
    Seed,
    Temp,
    served_lora,
)
from traces.regime import DECODE_SEED, DECODE_TEMP


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)


def bench(
    model: Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")],
    arms: Annotated[str, typer.Option(
        "--arms", help="Comma-separated: resident, engine-resident, resident-sync, on-demand, "
        "hot, staged, staged-oracle, staged-layer, staged-prerouter, staged-prerouter-hint, "
        "staged-prerouter-lora.")] \
        = "resident,on-demand,hot,staged",
    page_cache_budget: Annotated[str | None, typer.Option(
        "--page-cache-budget", help="Expert bytes kept in the page cache by streaming arms: "
        "bytes, 64M, 1G, or 25% (of the expert bytes). Default: no budget, warm.")] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Rounds (arm order rotates).")] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Decode tokens/prompt.")] = 64,
    prompts: Annotated[Path | None, typer.Option(
        "--prompts", help="JSONL prompts file (default: traces/prompts/default.jsonl).")] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Prompts used.")] = 2,
    json_out: Annotated[Path | None, typer.Option(
        "--json", help="Write the result JSON here (default reports/bench/NAME.json).")] = None,
    png: Annotated[Path | None, typer.Option(
        "--png", help="Bar chart path (default: next to the JSON, .png).")] = None,
    prerouter: Annotated[Path | None, typer.Option(
        "--prerouter", help="Heads for the staged-prerouter arm (default: MODEL/prerouter).")]
        = None,
    lora: LoraDir = None,
    no_lora: NoLora = False,
    temp: Temp = DECODE_TEMP,
    seed: Seed = DECODE_SEED,
    read_mbps: ReadMbps = None,
    read_iops: ReadIops = None,
    mem_limit: MemLimit = None,
    cpus: Cpus = None,
    cpu_quota: CpuQuota = None,
    before: Annotated[Path | None, typer.Option(
        "--before", help="The same model converted otherwise (e.g. ssdmoe convert --layout "
        "stacked): each streaming arm also runs on it as ARM@before, rotated and paired in the "
        "same rounds.")] = None,
    before_code: Annotated[Path | None, typer.Option(
        "--before-code", help="Another checkout of ssdmoe (e.g. git worktree add DIR COMMIT): "
        "each streaming arm also runs its engine as ARM@before (on --before's model when "
        "given), rotated and paired in the same rounds.")] = None,
    before_native_reads: Annotated[bool | None, typer.Option(
        "--before-native-reads/--before-python-reads", help="Each streaming arm also runs as "
        "ARM@before with these reader threads (with --before/--before-code, there), rotated "
        "and paired in the same rounds. Default: the same readers as ARM.")] = None,
    readers: Readers = None,
    native_reads: NativeReads = False,
    cache_policy: CachePolicy = None,
    from_json: Annotated[Path | None, typer.Option(
        "--from-json", help="Re-render the table and chart of an earlier result JSON "
        "(summary recomputed from its raw rounds); runs nothing.")] = None,
) -> None:
    """Benchmark resident mlx-lm against the streaming presets on one model."""
    from engine.bench.benchmark import (
        ARMS,
        PROMPTS,
        BenchSpec,
        expert_bytes,
        load_prompts,
        markdown_table,
        parse_bytes,
        resummarize,
        run_bench,
    )
    from engine.bench.plot import plot
    from engine.loader import open_manifest

    if from_json is not None:
        try:
            result = resummarize(json.loads(Path(from_json).read_text()))
        except (OSError, ValueError, KeyError) as err:
            raise BadInput(f"{from_json}: not a bench result ({err})") from None
        Path(from_json).write_text(json.dumps(result, indent=1) + "\n")
        plot(result, png or Path(from_json).with_suffix(".png"))
        typer.echo(markdown_table(result))
        return

    arm_list = [a.strip() for a in arms.split(",") if a.strip()]
    bad = [a for a in arm_list if a not in ARMS]
    if bad or not arm_list:
        raise BadInput(f"--arms: unknown arm {bad[0] if bad else '(none)'!r} "
                       f"(valid: {', '.join(ARMS)})")
    if len(set(arm_list)) != len(arm_list):
        raise BadInput("--arms: an arm is listed twice")
    if rounds < 1 or max_tokens < 2 or num_prompts < 1:
        raise BadInput("--rounds and --num-prompts must be >= 1, --max-tokens >= 2")
    if temp < 0:
        raise BadInput(f"--temp: must be >= 0, got {temp}")
    from engine.machine_limits import MachineLimits, check_available, describe

    limits = MachineLimits.parse(mem_limit, cpus, cpu_quota, read_mbps, read_iops)
    check_available(limits)
    throttle = limits.throttle
    manifest = open_manifest(model, verify=False)
    if before is not None:
        other = open_manifest(before, verify=False)
        same = (other.model_type, other.num_experts, other.bundle_bytes, other.config) == \
            (manifest.model_type, manifest.num_experts, manifest.bundle_bytes, manifest.config)
        if not same:
            raise BadInput(f"--before {before}: not the same model as {model} (model type, "
                           "experts, bundle bytes and config must match)")
    if before_code is not None and not (before_code / "engine" / "bench" / "arm.py").is_file():
        raise BadInput(f"--before-code {before_code}: not a checkout of ssdmoe (no "
                       "engine/bench/arm.py)")
    if readers is not None:
        from contract.engine_config import EngineConfig

        EngineConfig(readers=readers)  # a bad count is named here, not in a worker
    if cache_policy is not None:
        from contract.eviction import check_policy

        check_policy(cache_policy, "--cache-policy")  # named here, not in a worker
    adapter = None
    if any(a.startswith("staged-prerouter") for a in arm_list):
        from engine.prerouter import META, Prerouter

        heads_dir = prerouter or Path(model) / "prerouter"
        if not (heads_dir / META).is_file():
            raise BadInput(f"{heads_dir}: no prerouter heads for the staged-prerouter arms "
                           f"(make them with `ssdmoe train heads {model}`)")
        pre = Prerouter.load_for(heads_dir, manifest)
        if "staged-prerouter-hint" in arm_list and pre.hint is None:
            raise BadInput(f"{heads_dir}: no first-layer hint table for the "
                           f"staged-prerouter-hint arm (ssdmoe train hint {model})")
        if "staged-prerouter-lora" in arm_list:
            if no_lora:
                raise BadInput("--no-lora: the staged-prerouter-lora arm needs an adapter")
            adapter = served_lora(model, lora, False, heads_dir)
            if adapter is None:
                raise BadInput(f"{model}: no adapter for the staged-prerouter-lora arm trained "
                               f"for {heads_dir} (ssdmoe train sft {model}, or --lora DIR)")
            from engine.lora import read

            read(adapter)  # a bad file is named here, not in a worker
    total = expert_bytes(model)
    budget = None if page_cache_budget is None else parse_bytes(page_cache_budget, total)
    if budget is not None:
        need = manifest.top_k * manifest.bundle_bytes
        if budget < need:
            raise BadInput(f"--page-cache-budget {budget} bytes is smaller than one layer's "
                           f"working set: minimum {need} bytes")
    spec = BenchSpec(model=str(model), arms=arm_list,
                     prompts=load_prompts(prompts or PROMPTS, num_prompts),
                     max_tokens=max_tokens, rounds=rounds, page_cache_budget=budget,
                     prerouter=None if prerouter is None else str(prerouter), lora=adapter,
                     temp=temp, seed=seed, read_mbps=throttle.read_mbps,
                     read_iops=throttle.read_iops, mem_limit=limits.mem_limit, cpus=limits.cpus,
                     cpu_quota=limits.cpu_quota, readers=readers, native_reads=native_reads,
                     cache_policy=cache_policy, before=None if before is None else str(before),
                     before_code=None if before_code is None else str(before_code),
                     before_native_reads=before_native_reads)
    name = Path(model).name + ("" if budget is None else f"-budget{round(100 * budget / total)}")
    name += "" if throttle.read_mbps is None else f"-{throttle.read_mbps:g}mbps"
    name += "" if limits.mem_limit is None else f"-mem{limits.mem_limit >> 20}m"
    name += "" if limits.cpus is None else f"-{limits.cpus}cpu"
    name += "" if limits.cpu_quota is None else f"-quota{limits.cpu_quota:g}"
    json_path = json_out or Path("reports/bench") / f"{name}.json"
    png_path = png or json_path.with_suffix(".png")

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  transient=True) as bar:
        task = bar.add_task("measuring disk bandwidth", total=rounds * len(arm_list))
        seen = [0]

        def step(msg: str) -> None:
            if seen[0]:
                bar.advance(task)
            seen[0] += 1
            bar.update(task, description=msg)

        result = run_bench(spec, progress=step)
        bar.advance(task)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, png_path)
    typer.echo(f"{Path(model).name}: {len(spec.prompts)} prompts x {max_tokens} tokens, "
               f"{rounds} rounds, disk {result['disk_bandwidth_bytes_s'] / 1e6:.0f} MB/s"
               + ("" if throttle.read_mbps is None else " (the read throttle)") + ", "
               + (f"emulated machine: {describe(limits)}, " if limits.active else "")
               + ("page cache: what the memory limit leaves" if limits.mem_limit is not None
                  else "page cache warm" if budget is None else
                  f"page-cache budget {budget} bytes ({100 * budget / total:.0f}% of experts)"))
    typer.echo(markdown_table(result))
    mode = "greedy" if temp == 0 else f"sampled (temp {temp:g}, seed {seed})"
    typer.echo(f"{mode} tokens identical across arms (predicted-routing arms aside): "
               f"{result['tokens_identical']}")
    cost = result.get("lora_cost")
    if cost is not None:
        typer.echo(f"recovery LoRA ({adapter}): decode x{cost['decode_ratio_paired']:.3f} of "
                   f"staged-prerouter (paired by round), {cost['step_ms_added']:+.2f} ms/step; "
                   f"adapter load {1e3 * cost['load_s']:.1f} ms, {cost['bytes'] / 2**20:.2f} MiB")
    typer.echo(f"wrote {json_path} and {png_path}")
