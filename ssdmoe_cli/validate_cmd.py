"""`ssdmoe validate [MODEL] [--quick]`: run a matrix of real configurations on this machine
(page-cache budget, path and lead, storage throttle, K), capture a trace of each, predict each
with the simulator, and write reports/validation/ (Markdown, JSON, PNGs). Calibration comes
first (`ssdmoe calibrate`: microbenchmarks, into this machine's profile) and is kept apart from
the held-out configurations. Resumable: re-running keeps what was measured. The engine runs in
child processes; this process never imports MLX."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput, read_json_object
from ssdmoe_cli.options import CpuQuota, Cpus, MemLimit

DEFAULT_MODEL = Path("models") / "tiny-trained-stream"


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _model_name(model: Path) -> str:
    from sim.compare import profile_name

    return profile_name(model.resolve().name)


def _calibrate(model: Path, out: Path) -> dict:
    """`ssdmoe calibrate` into this machine's profiles (what `sim compare` reads)."""
    from validation.matrix_run import cli

    name = _model_name(model)
    hw = Path("scenarios/hardware/this-machine.toml")
    cmd = cli("calibrate", "--out", str(hw), "--model", str(model),
              "--model-out", f"scenarios/models/{name}.toml",
              "--scenario-out", f"scenarios/this-machine-{name}.toml",
              "--json", str(out / "calibration.json"))
    _say("validate: calibrating (ssdmoe calibrate: storage, kernel and graph-build "
         "microbenchmarks)")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BadInput(f"validate: calibration failed: {last}")
    info = {"command": " ".join(["ssdmoe", *cmd[3:]]), "profile": str(hw),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "calibration-run.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def _heads(model: Path, train: bool) -> Path | None:
    """MODEL/prerouter, trained first when missing and `train`; None when there are none."""
    heads = model / "prerouter"
    if (heads / "prerouter.json").is_file():
        return heads
    if not train:
        return None
    from validation.matrix_run import cli

    _say(f"validate: training prerouter heads into {heads} (ssdmoe train heads, ~6 min)")
    if subprocess.run(cli("train", "heads", str(model))).returncode != 0:
        raise BadInput(f"validate: ssdmoe train heads {model} failed")
    return heads


def _runnable(configs: list, model: Path, train_heads: bool) -> tuple[list, list[str], Path | None]:
    """(configurations this machine can run, names skipped, heads): throttled ones need the
    block-I/O throttle, staged-token ones prerouter heads; each skip is said in one line."""
    from engine import platform
    from engine.throttle import ThrottleSpec, ThrottleUnavailable, check_available

    skipped: list[str] = []
    if not platform.current().can_drop_pages:
        budgeted = [c for c in configs if c.page_cache != "all"]
        if budgeted:
            _say(f"validate: {platform.current().name} cannot hold the page cache to a budget; "
                 "the page-cache-budget configurations are skipped")
            skipped += [c.name for c in budgeted]
            configs = [c for c in configs if c.page_cache == "all"]
    if any(c.throttled for c in configs):
        try:
            check_available(ThrottleSpec(read_mbps=1.0))
        except ThrottleUnavailable as err:
            _say(f"validate: {err}; the throttled configurations are skipped")
            skipped += [c.name for c in configs if c.throttled]
            configs = [c for c in configs if not c.throttled]
    heads = _heads(model, train_heads) if any(c.path == "staged-token" for c in configs) \
        else None
    if heads is None and any(c.path == "staged-token" for c in configs):
        _say(f"validate: no prerouter heads in {model / 'prerouter'} (ssdmoe train heads): the "
             "staged-token configurations are skipped")
        skipped += [c.name for c in configs if c.path == "staged-token"]
        configs = [c for c in configs if c.path != "staged-token"]
    return configs, skipped, heads


def _start(out: Path, settings: dict, fresh: bool) -> None:
    """Keep earlier measurements in `out` unless --fresh or the model or settings changed."""
    stamp = out / "run-settings.json"
    if fresh or (stamp.is_file() and read_json_object(stamp) != settings):
        if stamp.is_file() and not fresh:
            _say("validate: model or settings changed since the last run: starting over")
        for sub in ("traces", "results", "simulated"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("calibration-run.json", "calibration-fit.json"):
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(settings) + "\n")


def _recompared(out: Path, settings: dict) -> str:
    """--recompare re-simulates the traces in `out` and never deletes them: the model sha they
    were captured on (a conversion elsewhere may hash differently: it is said, not fatal);
    any other setting that differs is bad input. Returns the traces' model sha."""
    stamp = out / "run-settings.json"
    if not stamp.is_file():
        raise BadInput(f"{stamp}: no earlier run to recompare (run ssdmoe validate first)")
    old = read_json_object(stamp)
    for key in ("prompts", "max_tokens", "rounds"):
        if old.get(key) != settings.get(key):
            raise BadInput(f"{stamp}: the traces were captured with {key}={old.get(key)}, "
                           f"this run asks {settings.get(key)}: --recompare keeps them as "
                           "captured (give the same settings, or --fresh to start over)")
    captured = str(old.get("model_sha256") or "")
    if captured != settings["model_sha256"]:
        _say(f"validate: the traces in {out} were captured on model manifest "
             f"{captured[:12]}, this model's is {settings['model_sha256'][:12]}: "
             "re-simulating them as they are (nothing is captured)")
    return captured


def _captured_by(out: Path) -> dict | None:
    """The command and date of the run that captured the traces in `out` (its report), or
    None when there is no earlier report."""
    report_file = out / "validation.json"
    if not report_file.is_file():
        return None
    doc = read_json_object(report_file)
    if not isinstance(doc.get("command"), str) or not isinstance(doc.get("date"), str):
        return None
    return {"command": doc["command"], "date": doc["date"]}


def _calibration(model: Path, out: Path, calibrate: bool) -> dict:
    cal_file = out / "calibration-run.json"
    if cal_file.is_file():  # a resumed run keeps its calibration
        return read_json_object(cal_file)
    if calibrate:
        return _calibrate(model, out)
    return {"command": "(not run: --no-calibrate; the committed profile)",
            "profile": "scenarios/hardware/this-machine.toml", "date": "-"}


def _refit_from_isolated(scenario: Path, fit_file: Path) -> None:
    """A resumed run (or --recompare) sets every fitted figure back to the isolated-loop value
    the first fit started from, before anything is compared: the fit is a few correction rounds
    of coupled figures, not a fixed point, so starting from where it ended walks it further on
    every rerun, and the same traces would not give the same report."""
    from validation.decode_fits import write_fit

    if not (scenario.is_file() and fit_file.is_file()):
        return
    for key, v in read_json_object(fit_file).items():
        write_fit(scenario, key, v["before"], "isolated-loop figure, refitted by ssdmoe "
                  "validate")


def _transfer(machines: Path, model: Path, out: Path, fresh: bool, calibrate: bool,
              rounds: int, max_tokens: int, prompts: int) -> None:
    """validate --transfer: calibrate on this machine with `model` (unless --no-calibrate or
    already done in `out`), capture every point of the machines file on its emulated machine,
    predict each from the committed profiles, write transfer.json and README.md in `out`."""
    from engine.machine_limits import MachineLimits, check_available
    from engine.throttle import ThrottleSpec
    from sim.compare import DEFAULT_HARDWARE
    from sim.profiles import load_hardware
    from validation import transfer as tr
    from validation.matrix_run import Plan, prompts_file

    plan = tr.load_machines(machines)
    tr.check_models(plan)
    for m in {p.machine for p in plan.points}:  # can each be set here? (one line if not)
        check_available(MachineLimits(
            cpus=m.cpus, cpu_quota=m.cpu_quota,
            mem_limit=1 << 30 if m.page_cache_share else None,
            throttle=ThrottleSpec(m.read_mbps, m.read_iops)))
    if rounds < 1 or max_tokens < 2 or prompts < 1:
        raise BadInput("--rounds and --prompts must be >= 1, --max-tokens >= 2")
    if out == Path("reports") / "validation":
        out = Path("reports") / "transfer" / "validate"
    settings = {"machines": str(machines), "rounds": rounds, "max_tokens": max_tokens,
                "prompts": prompts}
    _start(out, settings, fresh)
    if (model / "manifest.json").is_file():
        _calibration(model, out, calibrate)
    plan.out, plan.rounds, plan.max_tokens, plan.prompts = out, rounds, max_tokens, prompts
    prompt_file = prompts_file(Plan(model=model, out=out, prompts=prompts))
    # the machine's drift from its profile around the captures (none to make: not measured)
    measurable = (model / "manifest.json").is_file() and not all(
        tr.captured(plan.trace_dir(p, r)) for p in plan.points for r in range(rounds))
    before = _machine_now(model) if measurable else None
    t0 = time.perf_counter()
    results = tr.run(plan, prompt_file,
                     lambda msg: _say(f"{msg}  [{time.perf_counter() - t0:.0f} s]"))
    hw = load_hardware(DEFAULT_HARDWARE)
    if before is not None:
        after = _machine_now(model)
        machine = tr.drift(hw.expert_gbps, before[0], after[0], hw.cold_read_cpu_us_per_page,
                           before[1], after[1])
    else:  # nothing captured now: the drift measured around the captures, if recorded
        earlier = out / "transfer.json"
        machine = read_json_object(earlier).get("drift") if earlier.is_file() else None
    s = tr.summary(results)
    command = " ".join(["ssdmoe", *sys.argv[1:]])
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (out / "transfer.json").write_text(json.dumps(
        {"machines_file": str(machines),
         "machines": {k: vars(v) for k, v in plan.machines.items()},
         "own_bytes": plan.own, "results": results, "summary": s, "drift": machine,
         "command": command, "date": date}, indent=1) + "\n")
    table = tr.markdown(results, s)
    (out / "README.md").write_text(
        "# Transfer: calibrated here, predicted on emulated machines and a held-out model\n\n"
        f"`{command}` ({date}; machines: `{machines}`). Each point: measured (m) on its "
        "emulated machine, simulated (s) by `sim compare` from the committed profiles and the "
        "trace's own record of its machine, no refit. Medians over rounds.\n\n"
        + table + "\n" + (f"\n{tr.drift_text(machine)}\n" if machine else ""))
    typer.echo(table)
    if machine:
        typer.echo(tr.drift_text(machine))
    typer.echo(f"wrote {out / 'transfer.json'} and {out / 'README.md'}")


def _machine_now(model: Path) -> tuple[float, float]:
    """(expert kernel GB/s, a cold read's CPU us per page) measured now, as calibrate does."""
    from calibration.compute_probes import cold_page_cpu, expert_kernel_gbps
    from calibration.profile_values import page_slope_us

    return expert_kernel_gbps(model), page_slope_us(cold_page_cpu(model, n=16))


def _profile_fitter(scenario: Path, fit_file: Path, fitted: dict):
    """fit(calibration results): the calibration configurations fit the scenario's per-path
    costs (validation.decode_fits); the fit file keeps the isolated-loop figures of the first
    fit as `before` (a resumed run starts from them again: `_refit_from_isolated`)."""
    from validation.decode_fits import fit

    def fit_profile(cal_results: list[dict]) -> None:
        if not scenario.is_file():
            return
        first = read_json_object(fit_file) if fit_file.is_file() else {}
        for key, v in fit(cal_results, scenario).items():
            fitted[key] = {**v, "before": first.get(key, v)["before"]}
        fit_file.write_text(json.dumps(fitted, indent=1) + "\n")
        for key, v in fitted.items():
            _say(f"validate: {key} {v['before']:.4f} -> {v['after']:.4f} ms (fitted on the "
                 "calibration configuration, measured inside decode)")

    return fit_profile


def validate(
    model: Annotated[Path, typer.Argument(
        help="Converted model (default models/tiny-trained-stream).")] = DEFAULT_MODEL,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Fewer corners, prompts and tokens (< 10 min on 2 cores).")]
        = False,
    matrix: Annotated[Path | None, typer.Option(
        "--matrix", help="Matrix TOML ([axes], [defaults], [[corners]], [calibration]).")]
        = None,
    out: Annotated[Path, typer.Option(
        "--out", help="Report directory.")] = Path("reports") / "validation",
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Forget earlier measurements in --out and start over.")] = False,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate/--no-calibrate", help="Run ssdmoe calibrate first (default; a resumed "
        "run keeps its calibration).")] = True,
    train_heads: Annotated[bool, typer.Option(
        "--train-heads/--no-train-heads", help="Train prerouter heads if the model has none "
        "(needed by staged-token).")] = True,
    prompts: Annotated[int | None, typer.Option(
        "--prompts", help="Prompts per configuration (default 2 quick, 4 full).")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="Decode tokens per prompt (default 48 quick, 96 full).")] = None,
    read_mbps: Annotated[str | None, typer.Option(
        "--read-mbps", help="The storage axis's read throttles in MB/s, comma-separated "
        "(default 40,15; the corners run at the last).")] = None,
    read_iops: Annotated[str | None, typer.Option(
        "--read-iops", help="Also throttle by reads per second, comma-separated.")] = None,
    rounds: Annotated[int, typer.Option(
        "--rounds", help="Captures per configuration, order rotated per round; the median "
        "round is compared (this machine is noisy).")] = 1,
    recompare: Annotated[bool, typer.Option(
        "--recompare", help="Keep the captured traces and their calibration; refit and "
        "predict them again (after a simulator change).")] = False,
    mem_limit: MemLimit = None,
    cpus: Cpus = None,
    cpu_quota: CpuQuota = None,
    transfer: Annotated[Path | None, typer.Option(
        "--transfer", help="Transfer mode: the machines file's points (emulated machines, "
        "held-out models, other K), each captured on its machine and predicted from this "
        "machine's calibration with no refit (e.g. scenarios/transfer/machines.toml; report "
        "in --out, default reports/transfer/validate).")] = None,
) -> None:
    """Measure a matrix of real configurations, predict each with the simulator, report."""
    from dataclasses import asdict

    from sim.profiles import load_hardware
    from traces.regime import heldout_overlap
    from validation import matrix_run as run
    from validation import report
    from validation.matrix import default_matrix, load_matrix

    if transfer is not None:
        if mem_limit or cpus or cpu_quota or read_mbps or read_iops or matrix:
            raise BadInput("--transfer: the machines file sets the machines; give no "
                           "--mem-limit, --cpus, --cpu-quota, --read-mbps/--read-iops or "
                           "--matrix with it")
        _transfer(transfer, model, out, fresh, calibrate, rounds, max_tokens or 32,
                  prompts or 2)
        return
    if not (model / "manifest.json").is_file():
        raise BadInput(f"{model}: not a converted model (no manifest.json; ssdmoe convert)")
    from engine.machine_limits import MachineLimits, check_available

    machine = MachineLimits.parse(mem_limit, cpus, cpu_quota)  # every capture runs on it
    check_available(machine)
    throttles = [f"{t.strip()}mbps" for t in (read_mbps or "").split(",") if t.strip()]
    throttles += [f"{t.strip()}iops" for t in (read_iops or "").split(",") if t.strip()]
    if throttles and matrix is not None:
        raise BadInput("--read-mbps/--read-iops: the matrix file's storage axis sets the "
                       "throttles; give one or the other")
    m = load_matrix(matrix) if matrix is not None else default_matrix(quick, throttles or None)
    n_prompts = prompts or (2 if quick else 4)
    tokens = max_tokens or (48 if quick else 96)
    if n_prompts < 1 or tokens < 2:
        raise BadInput("--prompts must be >= 1 and --max-tokens >= 2")
    if rounds < 1:
        raise BadInput(f"--rounds: must be >= 1, got {rounds}")
    configs, skipped, heads = _runnable(m.configs(), model, train_heads)
    from engine.manifest import sha256_file

    sha = sha256_file(model / "manifest.json")
    if recompare and fresh:
        raise BadInput("--recompare keeps the captured traces; --fresh forgets them: one or "
                       "the other")
    settings = {"model_sha256": sha, "prompts": n_prompts, "max_tokens": tokens,
                **({"rounds": rounds} if rounds > 1 else {}),
                **({"machine": machine.to_dict()} if machine.active else {})}
    if recompare:
        sha = _recompared(out, settings)
        settings["model_sha256"] = sha
    _start(out, settings, fresh)
    if recompare:  # predictions only: the traces stay, results and fits are redone (the fit
        # file keeps the isolated-loop figures of the first fit)
        for sub in ("results", "simulated"):
            shutil.rmtree(out / sub, ignore_errors=True)
    cal = _calibration(model, out, calibrate)

    plan = run.Plan(model=model, out=out, prompts=n_prompts, max_tokens=tokens, heads=heads,
                    rounds=rounds, machine=machine.flags())
    t0 = time.perf_counter()

    def progress(i: int, n: int, c, what: str) -> None:
        _say(f"[{i}/{n}] {c.name} ({c.role}): {what}  [{time.perf_counter() - t0:.0f} s]")

    scenario = Path("scenarios") / f"this-machine-{_model_name(model)}.toml"
    _refit_from_isolated(scenario, out / "calibration-fit.json")
    fitted: dict = {}
    interrupted = False
    try:
        results = run.run(plan, configs, progress,
                          fit=_profile_fitter(scenario, out / "calibration-fit.json", fitted))
    except KeyboardInterrupt:  # keep what was measured, report it, say what is missing
        interrupted = True
        results = run.measured(plan, configs)
        _say("validate: interrupted; reporting what was measured")
    missing = [c.name for c in run.missing(plan, configs)] + skipped
    hw = load_hardware("this-machine")
    command = (" ".join(["ssdmoe", "validate", *sys.argv[2:]]) if len(sys.argv) > 1
               and sys.argv[1] == "validate" else f"ssdmoe validate {model}")
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    captured = _captured_by(out) if recompare else None  # the traces' own run
    meta = {"command": captured["command"] if captured else command,
            "date": captured["date"] if captured else now,
            **({"resimulated": {"command": command, "date": now}} if captured else {}),
            "machine": _machine(), "model": str(model), "model_sha256": sha,
            "prompts": n_prompts, "max_tokens": tokens, "rounds": rounds,
            "decode_routing": f"sampled at temperature {plan.temp} with seed {plan.seed}",
            "calibration": f"{cal['profile']}, {cal['command']}, {cal['date']}",
            "heldout_overlap": heldout_overlap(model)[0], "skipped": skipped,
            "fitted": fitted, "scenario": str(scenario)}
    doc = report.write_report(out, results, missing, meta, asdict(hw))
    s = doc["summary"]["decode_tok_s"]
    _say(f"validate: {len(results)} configurations in {time.perf_counter() - t0:.0f} s; "
         f"held-out decode tok/s error median {s['median_ape_pct'] or 0:.1f}%, "
         f"p90 {s['p90_ape_pct'] or 0:.1f}%")
    if missing:
        _say(f"validate: missing {len(missing)}: {', '.join(missing)} (re-run to measure them)")
    typer.echo(f"wrote {out / 'README.md'}, {out / 'validation.json'} and PNGs")
    if interrupted:
        raise typer.Exit(130)


def _machine() -> str:
    import os
    import platform

    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores"
