"""`ssdmoe advise`: search the engine's configurations with the simulator for one model on one
machine; print the frontier per K, recommend one, write JSON and a plot (no MLX)."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput

MACHINES = Path("scenarios/transfer/machines.toml")


def register(app: typer.Typer) -> None:
    app.command("advise")(advise)


def advise(
    model: Annotated[str, typer.Argument(
        help="Converted model directory, or a model profile (scenarios/models/NAME.toml).")],
    hardware: Annotated[str | None, typer.Option(
        "--hardware", help="Hardware profile (scenarios/hardware/NAME.toml). Default: this "
        "machine's calibrated one, with its fits inside decode where calibrate wrote "
        "scenarios/this-machine-MODEL.toml.")] = None,
    machine: Annotated[str | None, typer.Option(
        "--machine", help="An emulated machine of --machines by name (cores, CPU quota, "
        "read throttle, page-cache budget).")] = None,
    machines: Annotated[Path, typer.Option(
        "--machines", help="Machines file for --machine.")] = MACHINES,
    cpus: Annotated[int | None, typer.Option("--cpus", help="Emulated machine: N cores.")]
        = None,
    cpu_quota: Annotated[float | None, typer.Option(
        "--cpu-quota", help="Emulated machine: CPU time in cores' worth.")] = None,
    read_mbps: Annotated[float | None, typer.Option(
        "--read-mbps", help="Emulated machine: reads throttled to N MB/s.")] = None,
    read_iops: Annotated[int | None, typer.Option(
        "--read-iops", help="Emulated machine: N reads per second.")] = None,
    page_cache_fraction: Annotated[float | None, typer.Option(
        "--page-cache-fraction", help="Emulated machine: the engine's page-cache budget as a "
        "fraction of the expert bytes.")] = None,
    max_memory: Annotated[str | None, typer.Option(
        "--max-memory", help="Ceiling on the engine's memory (weights, KV, heads, app caches): "
        "700M, 1.5G.")] = None,
    ks: Annotated[list[int] | None, typer.Option(
        "--k", help="K values allowed (repeatable). Default: the model's own K and every K "
        "it has prerouter heads for.")] = None,
    min_k: Annotated[int | None, typer.Option(
        "--min-k", help="Only K at or above this.")] = None,
    min_top1: Annotated[float | None, typer.Option(
        "--min-top1", help="Only K whose ssdmoe eval row agrees with the teacher's top-1 at "
        "least this often (reports/quality).")] = None,
    objective: Annotated[str, typer.Option(
        "--objective", help="decode or prefill tok/s.")] = "decode",
    arms: Annotated[list[str] | None, typer.Option(
        "--arm", help="Arms to search (repeatable): on-demand, hot, staged, staged-layer, "
        "staged-token. Default: all.")] = None,
    routing: Annotated[list[Path] | None, typer.Option(
        "--routing", help="Replay this trace's routing at its K (repeatable); other K use the "
        "model profile's fitted routing statistics.")] = None,
    prompt_tokens: Annotated[int, typer.Option(
        "--prompt-tokens", help="Prompt length simulated (prefill tok/s).")] = 64,
    decode_steps: Annotated[int | None, typer.Option(
        "--decode-steps", help="Decode steps simulated (default: the scenario's).")] = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a scenario/hardware/model key for every candidate "
        "(key=value, repeatable), e.g. ram_gib=16.")] = None,
    backend: Annotated[str, typer.Option(
        "--backend", help="local (worker processes) or ray.")] = "local",
    address: Annotated[str | None, typer.Option(
        "--address", help="--backend ray: a cluster to join (default: a local one).")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", help="Local worker processes (default: the cores).")] = None,
    exhaustive_limit: Annotated[int, typer.Option(
        "--exhaustive-limit", help="Search every candidate up to this many; above it, the "
        "coordinate search (advise.search).")] = 400,
    top: Annotated[int, typer.Option("--top", help="Arms printed per K (each its best).")] = 5,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Directory for advise.json and frontier.png (default "
        "reports/advise/MODEL-MACHINE).")] = None,
) -> None:
    """Find the fastest way to run MODEL on a machine: path, lead, K, app cache, staged
    headroom, reads in flight and cache policy, predicted by the simulator."""
    from advise.frontier import OBJECTIVES, Constraints, Entry
    from advise.frontier import advise as pick
    from advise.machine import Machine, load_machine
    from advise.model import load_model
    from advise.predict import Setting, predict, scenario
    from advise.report import print_advice, to_json, write
    from advise.search import search
    from advise.space import ARMS, Space, check_arms

    if objective not in OBJECTIVES:
        raise BadInput(f"--objective {objective!r}: one of {', '.join(OBJECTIVES)}")
    if prompt_tokens < 1:
        raise BadInput(f"--prompt-tokens: must be >= 1, got {prompt_tokens}")
    if top < 1:
        raise BadInput(f"--top: must be >= 1, got {top}")
    if backend == "ray":
        from sim.sweep_ray import ray_module

        ray_module()  # not installed: one line now, not after the grid is built
    info = load_model(model)
    flags = {"cpus": cpus, "cpu_quota": cpu_quota, "read_mbps": read_mbps,
             "read_iops": read_iops, "page_cache_fraction": page_cache_fraction}
    given = {k: v for k, v in flags.items() if v is not None}
    if machine is not None:
        if given:
            raise BadInput(f"--machine {machine} and --{next(iter(given)).replace('_', '-')}: "
                           "give the machine by name or by its settings, not both")
        mach = load_machine(machines, machine)
    else:
        plain = hardware if hardware is not None else "this machine"
        mach = Machine(name="emulated" if given else plain, **given)
    ceiling = None
    if max_memory is not None:
        from engine.machine_limits import parse_size

        ceiling = parse_size(max_memory, "--max-memory")
    allowed = sorted(set(ks)) if ks else sorted({info.k, *info.heads})
    for k in allowed:
        if not 1 <= k <= info.experts:
            raise BadInput(f"--k {k}: must be in 1..{info.experts} (the model's experts)")
    if min_k is not None:
        allowed = [k for k in allowed if k >= min_k]
        if not allowed:
            raise BadInput(f"--min-k {min_k}: no K left (allowed: "
                           f"{', '.join(map(str, sorted(set(ks or [info.k]))))}; add --k)")
    chosen = check_arms(list(arms) if arms else list(ARMS))
    if arms and "staged-token" in chosen and not set(allowed) & set(info.heads):
        raise BadInput(f"--arm staged-token: no prerouter heads for K="
                       f"{', '.join(map(str, allowed))} in {info.where} (heads for K="
                       f"{', '.join(map(str, sorted(info.heads))) or 'none'}): the token lead "
                       "needs them (ssdmoe train heads)")
    traces = _routing(routing or [])
    setting = Setting(model=info, machine=mach, hardware=hardware, sets=list(sets or []),
                      prompt_tokens=prompt_tokens, decode_steps=decode_steps, routing=traces)
    space = Space(arms=chosen, ks=allowed, heads_k=set(info.heads),
                  default_readers=info.readers,
                  page_cache_budget=mach.page_cache_fraction is not None)
    scenario(setting, space.default(*space.lines()[0]))  # a bad profile: one line, now
    started = time.perf_counter()
    constraints = Constraints(max_engine_bytes=ceiling, min_top1=min_top1)
    key = OBJECTIVES[objective]
    over = ceiling if ceiling is not None else float("inf")

    def score(row: dict) -> float:
        return row[key] if row.get("peak_engine_bytes", 0) <= over else float("-inf")

    def run(cands: list) -> list[dict]:
        return predict(setting, cands, workers, backend, address)

    how, rows = search(space, run, score, exhaustive_limit)
    wall = time.perf_counter() - started
    entries = [Entry(c, row, info.quality(c.k, c.arm == "staged-token"))
               for c, row in rows.items()]
    advice = pick(entries, objective, constraints, mach.read_mbps)
    rec = advice.recommended
    if rec is not None and rec.candidate.k != info.k:  # K costs quality: say how much
        from advise.report import quality_text

        own = info.quality(info.k, False)
        advice.reason += (f"; K={rec.candidate.k} is not the model's own K={info.k} (quality "
                          f"{quality_text(rec.quality)} against {quality_text(own)}; --min-k "
                          f"or --min-top1 keep it)")
    command = shlex.join(["ssdmoe", *sys.argv[1:]])
    print_advice(typer.echo, setting, advice, how, top, wall)
    if out is None:
        out = Path("reports/advise") / f"{info.name}-{mach.name.replace(' ', '-')}"
    title = f"{info.name} on {mach.name}, hardware {hardware or 'this-machine'}"
    paths = write(out, to_json(setting, advice, how, wall, command), advice, title, ceiling)
    typer.echo(f"wrote {', '.join(map(str, paths))}")
    if advice.recommended is None:
        raise BadInput(f"advise: no configuration meets the constraints: {advice.reason}")


def _routing(paths: list[Path]) -> dict[int, str]:
    """K -> trace directory whose routing replays (one per K)."""
    import json

    out: dict[int, str] = {}
    for p in paths:
        run = p / "run.json"
        if not run.is_file():
            raise BadInput(f"--routing {p}: not a trace directory (no run.json)")
        try:
            engine = json.loads(run.read_text()).get("engine") or {}
            k = int(engine.get("k") or engine.get("top_k"))
        except (ValueError, TypeError, AttributeError):
            raise BadInput(f"{run}: no routing K recorded (engine.k)") from None
        if k in out:
            raise BadInput(f"--routing {p}: a second trace at K={k} (the first: {out[k]})")
        out[k] = str(p)
    return out
