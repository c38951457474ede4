"""Transfer: calibrate once on this machine, predict the rest. A machines file names emulated
machines (engine.machine_limits: the kernel's control groups) and the points to run on them
(model, machine, decode path, K); each point is captured on its machine and predicted by
`sim compare` from the committed profiles and the trace's own record of its machine, with no
refit: nothing the simulator uses was fitted on a held-out machine or model.

Machines file (TOML):
    [machines.one-core]           # a name
    cpus = 1                      # --cpus
    cpu_quota = 0.5               # --cpu-quota (cores' worth of CPU time)
    page_cache = "1/4"            # the engine's page-cache budget: "all", "1/2" or "1/4"
    page_cache_share = 0.5        # instead: a memory limit leaving the page cache about this
                                  # share of the model's expert bytes (the process's own memory,
                                  # measured by a short capture on this machine, plus the share)
    read_mbps = 100               # --read-mbps;  read_iops = N: --read-iops
    description = "..."

    [[points]]
    model = "models/tiny-trained-stream"   # a converted model (prerouter heads for staged-token)
    machines = ["one-core"]
    paths = ["on-demand", "staged-token"]
    k = [2, 8]                             # optional: route at these K (default the model's)

No MLX here: every capture is its own `ssdmoe capture` process."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import BadInput, read_toml_table
from contract.thresholds import PAGE_CACHE_SHARES
from engine.bench.benchmark import expert_bytes
from validation.matrix import Config
from validation.matrix_run import cli

MACHINE_KEYS = ("cpus", "cpu_quota", "page_cache", "page_cache_share", "read_mbps",
                "read_iops", "description")
POINT_KEYS = ("model", "machines", "paths", "k")
PATHS = ("on-demand", "staged-token", "staged", "hot", "staged-layer")
METRICS = ("decode_tok_s", "blocked_ms_per_step", "build_ms_per_step", "eval_ms_per_step",
           "cold_fraction", "cpu_ms_per_step", "main_cpu_ms_per_step", "reader_cpu_ms_per_step")
COMPONENTS = ("blocked_ms_per_step", "build_ms_per_step", "eval_ms_per_step")
NAN = float("nan")
# the issue's targets over held-out machines and models (decode tok/s; components)
TARGET_MEDIAN_PCT, TARGET_P90_PCT, TARGET_COMPONENT_MEDIAN_PCT = 8.0, 15.0, 15.0


@dataclass(frozen=True)
class Machine:
    name: str
    cpus: int | None = None
    cpu_quota: float | None = None
    page_cache: str = "all"
    page_cache_share: float | None = None
    read_mbps: float | None = None
    read_iops: int | None = None
    description: str = ""

    def flags(self, own_bytes: int, experts: int) -> list[str]:
        """`ssdmoe capture` flags for this machine (own_bytes: the process's own memory)."""
        out: list[str] = []
        if self.cpus is not None:
            out += ["--cpus", str(self.cpus)]
        if self.cpu_quota is not None:
            out += ["--cpu-quota", f"{self.cpu_quota:g}"]
        if self.page_cache_share is not None:
            out += ["--mem-limit", str(int(own_bytes + self.page_cache_share * experts))]
        elif PAGE_CACHE_SHARES[self.page_cache] is not None:
            out += ["--page-cache-fraction", str(PAGE_CACHE_SHARES[self.page_cache])]
        if self.read_mbps is not None:
            out += ["--read-mbps", f"{self.read_mbps:g}"]
        if self.read_iops is not None:
            out += ["--read-iops", str(self.read_iops)]
        return out


@dataclass(frozen=True)
class Point:
    model: Path
    machine: Machine
    path: str
    k: str = "native"

    @property
    def name(self) -> str:
        k = "" if self.k == "native" else f"-k{self.k}"
        return f"{self.model.name}/{self.machine.name}/{self.path}{k}"

    def config(self) -> Config:
        """The validation matrix's configuration (its capture arguments), on base storage: the
        machine's flags add the rest."""
        return Config(page_cache="all", path=self.path, k=self.k)


@dataclass
class TransferPlan:
    points: list[Point]
    machines: dict[str, Machine]
    out: Path
    rounds: int = 1
    max_tokens: int = 32
    prompts: int = 2
    source: str = ""
    own: dict[str, int] = field(default_factory=dict)  # footprint key -> bytes

    def trace_dir(self, p: Point, round_: int) -> Path:
        return self.out / "traces" / f"{p.name}.r{round_}"


def _typed(where: str, key: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise BadInput(f"{where}: {key} {value!r}: expected {kind.__name__}")
    return kind(value)


def _check_keys(where: str, table: Any, known: tuple[str, ...]) -> None:
    """A table whose keys are all `known`, else one line naming the first one that is not."""
    if not isinstance(table, dict):
        raise BadInput(f"{where}: expected a table")
    bad = set(table) - set(known)
    if bad:
        raise BadInput(f"{where}: unknown key {sorted(bad)[0]!r} (known: {', '.join(known)})")


def load_machines(path: Path) -> TransferPlan:
    """The machines file: one line naming the file and the key for anything wrong."""
    d = read_toml_table(path)
    unknown = set(d) - {"machines", "points"}
    if unknown:
        raise BadInput(f"{path}: unknown section {sorted(unknown)[0]!r} (known: machines, "
                       "points)")
    machines: dict[str, Machine] = {}
    for name, m in (d.get("machines") or {}).items():
        where = f"{path}: machines.{name}"
        _check_keys(where, m, MACHINE_KEYS)
        kinds = {"cpus": int, "cpu_quota": float, "page_cache": str, "page_cache_share": float,
                 "read_mbps": float, "read_iops": int, "description": str}
        values = {k: _typed(where, k, v, kinds[k]) for k, v in m.items()}
        if values.get("page_cache", "all") not in PAGE_CACHE_SHARES:
            raise BadInput(f"{where}: page_cache {values['page_cache']!r}: expected one of "
                           f"{', '.join(PAGE_CACHE_SHARES)}")
        share = values.get("page_cache_share")
        if share is not None and not 0 < share <= 1:
            raise BadInput(f"{where}: page_cache_share {share}: expected (0, 1]")
        if share is not None and "page_cache" in values:
            raise BadInput(f"{where}: page_cache and page_cache_share: give one")
        machines[name] = Machine(name=name, **values)
    points: list[Point] = []
    for i, p in enumerate(d.get("points") or [], 1):
        where = f"{path}: points #{i}"
        _check_keys(where, p, POINT_KEYS)
        if "model" not in p or "machines" not in p:
            raise BadInput(f"{where}: needs model and machines")
        model = Path(p["model"])
        for name in p["machines"]:
            if name not in machines:
                raise BadInput(f"{where}: machine {name!r} is not in [machines]")
        paths = p.get("paths", ["on-demand"])
        for path_name in paths:
            if path_name not in PATHS:
                raise BadInput(f"{where}: path {path_name!r}: expected one of {', '.join(PATHS)}")
        ks = [str(_typed(where, "k", k, int)) for k in p.get("k", [])] or ["native"]
        points += [Point(model, machines[m], path_name, k)
                   for m in p["machines"] for path_name in paths for k in ks]
    if not points:
        raise BadInput(f"{path}: no [[points]]")
    return TransferPlan(points=points, machines=machines, out=Path(), source=str(path))


def check_models(plan: TransferPlan) -> None:
    for p in plan.points:
        if not (p.model / "manifest.json").is_file():
            raise BadInput(f"{plan.source}: {p.model}: not a converted model (ssdmoe convert)")
        if p.path == "staged-token" and not (p.model / "prerouter" / "prerouter.json").is_file():
            raise BadInput(f"{plan.source}: {p.model}: staged-token needs prerouter heads "
                           f"(ssdmoe train heads {p.model})")


def _capture(plan: TransferPlan, p: Point, out: Path, prompts: Path, tokens: int,
             machine: list[str]) -> None:
    heads = p.model / "prerouter" if p.path == "staged-token" else None
    cmd = cli("capture", str(p.model), "--out", str(out), "--force", "--no-progress",
              "--no-verify", "--prompts", str(prompts), "--max-tokens", str(tokens),
              *p.config().capture_args(heads), *machine)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BadInput(f"validate --transfer: {p.name}: capture failed: {last}")


# What a run allocates beyond its measured footprint at its peak (MLX's temporaries of a step,
# KV growth past the probe's 2 tokens): room the limit leaves so the kernel's OOM killer does not
# end the run. It is page cache while the process does not use it (the simulator is told the
# page cache from the group's own record: sim.compare).
HEADROOM = 32 * 2**20


def own_memory(plan: TransferPlan, p: Point, prompts: Path) -> int:
    """The process's own memory for this model, path and K: a 2-token capture on this machine
    (run.json extra.process, the larger of after load and at exit, plus HEADROOM), cached per
    plan."""
    key = f"{p.model.name}/{p.path}/{p.k}"
    if key not in plan.own:
        out = plan.out / "footprint" / key.replace("/", "-")
        _capture(plan, p, out, prompts, 2, [])
        proc = json.loads((out / "run.json").read_text())["extra"]["process"]
        plan.own[key] = max(proc["own_bytes_after_load"], proc.get("own_bytes_at_exit", 0)) \
            + HEADROOM
    return plan.own[key]


def captured(trace: Path) -> bool:
    try:
        return bool(json.loads((trace / "run.json").read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def compare_trace(trace: Path) -> dict[str, tuple[float, float]]:
    """(measured, simulated) per metric, from `sim compare` on the committed profiles."""
    from sim.compare import compare
    from traces.reader import read_trace

    c = compare(read_trace(trace)).to_dict()
    out = {}
    for key in METRICS:
        if key in c["metrics"]:
            out[key] = (c["metrics"][key]["measured"], c["metrics"][key]["simulated"])
        else:
            out[key] = (c["sim"][f"measured_{key}"], c["sim"][key])
    return out


def run(plan: TransferPlan, prompts: Path,
        progress: Callable[[str], None] = lambda _: None) -> list[dict]:
    """Capture every point not captured yet (rounds rotate the order), then predict each."""
    n = len(plan.points)
    failed: dict[str, str] = {}
    for r in range(plan.rounds):
        shift = (r * 5) % n
        for i, p in enumerate(plan.points[shift:] + plan.points[:shift], 1):
            trace = plan.trace_dir(p, r)
            if captured(trace) or p.name in failed:
                continue
            progress(f"[round {r + 1}/{plan.rounds}, {i}/{n}] {p.name}")
            try:
                own = own_memory(plan, p, prompts) if p.machine.page_cache_share else 0
                _capture(plan, p, trace, prompts, plan.max_tokens,
                         p.machine.flags(own, expert_bytes(p.model)))
            except BadInput as err:  # reported, and the run goes on
                failed[p.name] = str(err)
                progress(f"  failed: {err}")
    results: list[dict] = [{"point": name, "failed": why} for name, why in failed.items()]
    for p in plan.points:
        rounds = [compare_trace(plan.trace_dir(p, r)) for r in range(plan.rounds)
                  if captured(plan.trace_dir(p, r))]
        if not rounds:
            continue
        results.append({
            "point": p.name, "model": p.model.name, "machine": p.machine.name,
            "path": p.path, "k": p.k, "rounds": len(rounds),
            **{k: {"measured": _median(x[k][0] for x in rounds),
                   "simulated": _median(x[k][1] for x in rounds)} for k in METRICS}})
    return results


def _median(values) -> float | None:
    """The median of the known values (None: a trace that did not record the figure)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def error_pct(r: dict, key: str) -> float:
    m, s = r[key]["measured"], r[key]["simulated"]
    return 100 * (s / m - 1) if m and s is not None else float("nan")


def p90(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(0.9 * (len(v) - 1))))] if v else float("nan")


def summary(results: list[dict]) -> dict[str, Any]:
    failed = [r["point"] for r in results if "failed" in r]
    results = [r for r in results if "failed" not in r]
    decode = [abs(error_pct(r, "decode_tok_s")) for r in results]
    comps = [abs(error_pct(r, k)) for r in results for k in COMPONENTS
             if r[k]["measured"] > 0.5]  # a component under 0.5 ms/step: no percentage
    med = statistics.median(decode) if decode else float("nan")
    comp = statistics.median(comps) if comps else float("nan")
    return {"points": len(results), "failed": failed, "decode_abs_error_median_pct": med,
            "decode_abs_error_p90_pct": p90(decode),
            "component_abs_error_median_pct": comp,
            "targets": {"decode_median_pct": TARGET_MEDIAN_PCT, "decode_p90_pct": TARGET_P90_PCT,
                        "component_median_pct": TARGET_COMPONENT_MEDIAN_PCT},
            "met": bool(not failed and med <= TARGET_MEDIAN_PCT
                        and p90(decode) <= TARGET_P90_PCT
                        and comp <= TARGET_COMPONENT_MEDIAN_PCT)}


def drift(profile_gbps: float, before: float, after: float, profile_page_us: float = NAN,
          page_us_before: float = NAN, page_us_after: float = NAN) -> dict[str, float]:
    """The machine against its profile: the quantized expert kernel's rate (expert_gbps, the
    figure a wide model's decode step scales with) and a cold read's CPU per page
    (cold_read_cpu_us_per_page, what a wide model's cold loads scale with; it drifts with the
    host's load), each in the profile the points are predicted from, measured
    right before the captures and right after, and how far each lies from the profile
    (percent)."""
    def pct(x: float, profile: float) -> float:
        return 100 * (x / profile - 1) if profile > 0 else NAN
    return {"profile_expert_gbps": profile_gbps, "before_expert_gbps": before,
            "after_expert_gbps": after, "before_pct": pct(before, profile_gbps),
            "after_pct": pct(after, profile_gbps),
            "profile_cold_page_us": profile_page_us, "before_cold_page_us": page_us_before,
            "after_cold_page_us": page_us_after,
            "cold_page_before_pct": pct(page_us_before, profile_page_us),
            "cold_page_after_pct": pct(page_us_after, profile_page_us)}


def drift_text(d: dict[str, float]) -> str:
    text = (f"The machine against its profile: the expert kernel's rate (`expert_gbps`, "
            f"calibration.compute_probes.expert_kernel_gbps) was {d['profile_expert_gbps']:.3f} "
            f"GB/s in the profile, {d['before_expert_gbps']:.3f} right before the captures "
            f"({d['before_pct']:+.1f}%) and {d['after_expert_gbps']:.3f} right after "
            f"({d['after_pct']:+.1f}%). A decode step of the wide model is mostly this kernel: "
            "errors of about that size can be the machine's drift, not the simulator's "
            "(reports/cross-machine, \"What one calibration decides\").")
    if not math.isnan(d.get("before_cold_page_us", NAN)):  # measured (runs before it: not)
        text += (f" A cold read's CPU per page (`cold_read_cpu_us_per_page`, "
                 f"calibration.compute_probes.cold_page_cpu) was "
                 f"{d['profile_cold_page_us']:.3f} us in the profile, "
                 f"{d['before_cold_page_us']:.3f} before ({d['cold_page_before_pct']:+.1f}%) "
                 f"and {d['after_cold_page_us']:.3f} after ({d['cold_page_after_pct']:+.1f}%).")
    return text


def markdown(results: list[dict], s: dict[str, Any]) -> str:
    lines = ["| point | rounds | decode tok/s measured | simulated | error | blocked ms/step "
             "m / s | build ms/step m / s | eval ms/step m / s | cold fraction m / s | CPU "
             "ms/step m / s | main-thread CPU ms/step m / s | reader CPU ms/step m / s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['point']} | failed: {r['failed']} |" + " - |" * 10)
            continue

        def ms(k: str, fmt: str = ".1f", r: dict = r) -> str:
            m, s = r.get(k, {}).get("measured"), r.get(k, {}).get("simulated")
            return "-" if m is None or s is None else f"{m:{fmt}} / {s:{fmt}}"
        lines.append(f"| {r['point']} | {r['rounds']} | {r['decode_tok_s']['measured']:.2f} | "
                     f"{r['decode_tok_s']['simulated']:.2f} | "
                     f"{error_pct(r, 'decode_tok_s'):+.0f}% | {ms('blocked_ms_per_step')} | "
                     f"{ms('build_ms_per_step')} | {ms('eval_ms_per_step')} | "
                     f"{ms('cold_fraction', '.2f')} | {ms('cpu_ms_per_step')} | "
                     f"{ms('main_cpu_ms_per_step')} | {ms('reader_cpu_ms_per_step', '.2f')} |")
    lines += ["", f"Decode tok/s over {s['points']} held-out points: median absolute error "
              f"{s['decode_abs_error_median_pct']:.1f}% (target {TARGET_MEDIAN_PCT:g}%), p90 "
              f"{s['decode_abs_error_p90_pct']:.1f}% (target {TARGET_P90_PCT:g}%); components "
              f"(build, eval, blocked, where above 0.5 ms/step) median "
              f"{s['component_abs_error_median_pct']:.1f}% (target "
              f"{TARGET_COMPONENT_MEDIAN_PCT:g}%): targets {'met' if s['met'] else 'missed'}."]
    return "\n".join(lines)
