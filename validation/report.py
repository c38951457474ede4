"""The validation report: Markdown, JSON and PNGs from the per-configuration results
(validation.matrix_run). Errors are absolute percentage errors of simulated against measured; the
summary takes the held-out configurations only (the calibration configuration is shown, marked,
and left out). For the worst configuration the measured and simulated timelines of one decode
step are drawn side by side, and the component (graph build, evaluation, blocked on loads)
whose per-step time is furthest off is named. No MLX here."""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from traces.schema import DEMAND
from validation import plots
from validation.labels import LABELS
from validation.matrix_run import METRICS
from validation.noise import noise_summary
from validation.thread_errors import THREADS, complete_split, signed_errors

COMPONENTS = ("build_ms_per_step", "eval_ms_per_step", "blocked_ms_per_step")
# The token lead holds its bound when it decodes at least this share of it (issue 45's target:
# 0.85 in every storage regime of the matrix)
BOUND_SHARE = 0.85


def _p90(values: list[float]) -> float:
    return float(np.percentile(values, 90)) if values else float("nan")


def error_summary(results: list[dict]) -> dict[str, dict[str, float | int]]:
    """Per metric over held-out configurations: median and p90 APE, and how many had one."""
    held = [r for r in results if r["config"]["role"] == "held-out"]
    out = {}
    for k in METRICS:
        vals = [r["ape_pct"][k] for r in held if r["ape_pct"].get(k) is not None]
        out[k] = {"median_ape_pct": statistics.median(vals) if vals else None,
                  "p90_ape_pct": _p90(vals) if vals else None, "n": len(vals)}
    return out


def round_spread_pct(r: dict) -> float | None:
    """How far a configuration's farthest round lies from its rounds' median decode tok/s (% of
    that median): the noise its measured figures carry. None with fewer than two rounds."""
    speeds = [v for v in r.get("rounds_decode_tok_s") or [] if v is not None]
    if len(speeds) < 2:
        return None
    mid = statistics.median(speeds)
    return 100.0 * max(abs(v - mid) for v in speeds) / mid if mid > 0 else None


def spread_summary(results: list[dict]) -> dict[str, float | int | None]:
    """Median and p90 round spread over the held-out configurations (round_spread_pct)."""
    vals = [v for r in results if r["config"]["role"] == "held-out"
            if (v := round_spread_pct(r)) is not None]
    return {"median_pct": statistics.median(vals) if vals else None,
            "p90_pct": _p90(vals) if vals else None, "n": len(vals)}


def responsible(r: dict) -> tuple[str, float]:
    """The per-step component whose simulated time is furthest from the measured (ms)."""
    diffs = {}
    for k in COMPONENTS:
        m, s = r["measured"].get(k), r["simulated"].get(k)
        if m is not None and s is not None:
            diffs[k] = s - m
    if not diffs:
        return "unknown", 0.0
    k = max(diffs, key=lambda c: abs(diffs[c]))
    return k, diffs[k]


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------- the prerouter's gain


@functools.cache  # the gain table and the bound read the same traces
def _trace_io(trace_dir: str) -> dict[str, float]:
    """Cold bytes and cold loads per decode step, from the trace's loads table."""
    import polars as pl

    from traces.reader import read_trace

    t = read_trace(Path(trace_dir))
    steps = t.steps.filter(pl.col("phase") == "decode")
    n = max(steps.height, 1)
    decode_steps = set(steps["step"].to_list())
    loads = t.loads.filter(pl.col("step").is_in(list(decode_steps)))
    cold = loads.filter(pl.col("cold"))
    demand = loads.filter(pl.col("source") == DEMAND)
    return {"cold_mib_per_step": float(cold["bytes"].sum()) / 2**20 / n,
            "cold_loads_per_step": cold.height / n,
            "demand_blocked_ms_per_step": float(demand["wait_ns"].sum()) / 1e6 / n}


def gain_analysis(results: list[dict], hardware: dict[str, Any]) -> dict[str, Any]:
    """Section 5.3 of the paper on this machine: under the tightest throttle, token lead vs
    on-demand vs layer lead; and the bound for every token-lead configuration."""
    by = {r["config"]["name"]: r for r in results}
    throttles = sorted({r["config"]["storage"] for r in results
                        if r["config"]["storage"].endswith("mbps")},
                       key=lambda s: float(s[:-4]))
    out: dict[str, Any] = {"arms": {}, "bounds": []}
    compute = by.get("staged-token-pcall-unthrottled")
    compute_ms = compute["measured"]["step_ms_p50"] if compute else None
    out["compute_step_ms"] = compute_ms
    out["compute_source"] = ("step p50 of staged-token with every expert in the page cache"
                             if compute else None)
    if throttles:
        tight = throttles[0]
        out["throttle"] = tight
        for path in ("on-demand", "staged-layer", "staged-token"):
            r = by.get(f"{path}-pc25-{tight}")
            if r is None:
                continue
            m = r["measured"]
            step = 1e3 / m["decode_tok_s"] if m.get("decode_tok_s") else None
            out["arms"][path] = {
                "decode_tok_s": m.get("decode_tok_s"), "mib_per_step": m.get("mib_per_step"),
                "loads_per_step": m.get("loads_per_step"), "mib_per_load": m.get("mib_per_load"),
                "cold_fraction": m.get("cold_fraction"),
                "blocked_ms_per_step": m.get("blocked_ms_per_step"),
                "blocked_share": (m["blocked_ms_per_step"] / step
                                  if step and m.get("blocked_ms_per_step") is not None else None),
                **_trace_io(r["trace"])}
        arms = out["arms"]
        if "on-demand" in arms and "staged-token" in arms:
            out["gain_over_on_demand"] = (arms["staged-token"]["decode_tok_s"]
                                          / arms["on-demand"]["decode_tok_s"])
        if "staged-layer" in arms and "staged-token" in arms:
            out["gain_over_layer_lead"] = (arms["staged-token"]["decode_tok_s"]
                                           / arms["staged-layer"]["decode_tok_s"])
    disk = hardware["ssd_bandwidth_gbps"] * 1e9
    latency, qd = hardware["ssd_latency_ms"], hardware["queue_depth"]
    for r in results:
        c = r["config"]
        if c["path"] != "staged-token" or compute_ms is None:
            continue
        io = _trace_io(r["trace"])
        bw = min(disk, float(c["storage"][:-4]) * 1e6) if c["storage"].endswith("mbps") \
            else disk
        terms = {"compute_ms": compute_ms,
                 "bandwidth_ms": io["cold_mib_per_step"] * 2**20 / bw * 1e3,
                 "latency_ms": io["cold_loads_per_step"] * latency / qd}
        bound = 1e3 / max(terms.values())
        got = r["measured"]["decode_tok_s"]
        entry = {"config": c["name"], "measured_tok_s": got, "bound_tok_s": bound,
                 "ratio": got / bound, "holds": got >= BOUND_SHARE * bound,
                 "limit": max(terms, key=terms.get), **terms}
        if not entry["holds"]:
            entry["between"] = _between(r, io, compute_ms, latency, qd)
        out["bounds"].append(entry)
    return out


def _between(r: dict, io: dict[str, float], compute_ms: float, latency: float,
             qd: int) -> str:
    """What stands between a token-lead configuration and its bound, from its trace."""
    m = r["measured"]
    step = 1e3 / m["decode_tok_s"]
    blocked = m.get("blocked_ms_per_step") or 0.0
    cold = io["cold_loads_per_step"]
    extra = step - compute_ms
    demand = io["demand_blocked_ms_per_step"]
    if cold and blocked >= 0.5 * extra:
        return (f"the step is {step:.1f} ms against a compute step of {compute_ms:.1f} ms; "
                f"{blocked:.1f} ms of it is blocked on {cold:.1f} cold loads per step, "
                f"{blocked / cold:.2f} ms per cold load against a device latency of "
                f"{latency:.3f} ms at queue depth {qd}: the cost of a load inside decode (its "
                "syscalls, copies and reader hand-offs, competing for this machine's 2 cores "
                "with graph building and MLX's compute thread), not the device, stands "
                f"between; {demand:.1f} ms of the blocked time is on demand loads, read after "
                "their own layer's router: the layers no head predicts (the first MoE layer)")
    build = m.get("build_ms_per_step") or 0.0
    return (f"the step is {step:.1f} ms against a compute step of {compute_ms:.1f} ms with only "
            f"{blocked:.1f} ms blocked ({demand:.1f} ms of it on demand loads, the layers no "
            f"head predicts): main-thread work (build {build:.1f} ms/step) and evaluation "
            "stand between")


# ---------------------------------------------------------------- figures


# ---------------------------------------------------------------- the report


def write_report(out: Path, results: list[dict], missing: list[str], meta: dict[str, Any],
                 hardware: dict[str, Any]) -> dict[str, Any]:
    """reports/validation/README.md, validation.json, scatter.png, errors.png,
    worst-timeline.png."""
    results = sorted(results, key=lambda r: (r["config"]["role"] != "calibration",
                                             r["config"]["name"]))
    summary = error_summary(results)
    held = [r for r in results if r["config"]["role"] == "held-out"]
    worst = max(held, key=lambda r: r["ape_pct"].get("decode_tok_s") or -1, default=None)
    gain = gain_analysis(results, hardware)
    doc = {**meta, "summary": summary, "round_spread": spread_summary(results),
           "noise": noise_summary(results), "missing": missing, "gain": gain,
           "worst": worst["config"]["name"] if worst else None, "results": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if results:
        plots.plot_scatter(results, out / "scatter.png")
        plots.plot_errors(results, out / "errors.png")
    if worst is not None:
        plots.plot_timelines(worst, out / "worst-timeline.png")
    (out / "README.md").write_text(_markdown(doc, results, worst, out))
    return doc


def _markdown(doc: dict, results: list[dict], worst: dict | None, out: Path) -> str:
    lines = ["# Simulator vs this machine: `ssdmoe validate`", "",
             f"Produced by `{doc['command']}` on {doc['date']} ({doc['machine']}). "
             + (f"Re-simulated by `{doc['resimulated']['command']}` on "
                f"{doc['resimulated']['date']} (the same traces, predicted again). "
                if doc.get("resimulated") else "")
             + f"Model `{doc['model']}`, manifest sha256 `{doc['model_sha256']}`. "
             f"Each configuration is its own `ssdmoe capture` process: {doc['prompts']} prompts x "
             f"{doc['max_tokens']} decode tokens, decode routing {doc['decode_routing']}. "
             f"Simulated by `sim compare` on the profile `ssdmoe calibrate` wrote "
             f"({doc['calibration']}). The calibration subset is those microbenchmarks plus the "
             "configurations marked calibration below (one per decode path, every expert in "
             "the page cache; and two at half the page cache, one reading cold on the main "
             "thread, one through reader threads); every other configuration is held out and "
             "only predicted.", ""]
    if (doc.get("rounds") or 1) > 1:
        lines += [f"Every configuration was captured {doc['rounds']} times, the order of the "
                  "configurations (calibration and held-out alike) rotated from round to "
                  "round. Each measured figure below is its median over the rounds, on its own "
                  "(a slow spell can stretch one round's build and another's blocked time), and "
                  "the simulator replays the round with the median decode tok/s (the rounds "
                  "route alike: decoding is seeded). The rounds' decode tok/s: the last column "
                  "below.", ""]
    if doc.get("fitted"):
        lines += [f"What the calibration configurations fitted (`validation/decode_fits.py`, "
                  f"written to `{doc.get('scenario')}`): each path's main-thread cost per layer, "
                  "the accelerator's time, a warm and a cold load's cost, a reader's wake-up "
                  "and its hand-off, measured inside decode "
                  "instead of in the isolated loops of `ssdmoe calibrate`:", "",
                  "| parameter | isolated loop | inside decode (fitted) |", "|---|---|---|"]
        for key, v in doc["fitted"].items():
            unit = "" if key == "compute_factor" else " ms"
            lines.append(f"| `{key}` | {v['before']:.4f}{unit} | {v['after']:.4f}{unit} |")
        lines.append("")
    if doc["missing"]:
        lines += [f"**Incomplete run**: {len(doc['missing'])} configurations missing: "
                  + ", ".join(f"`{m}`" for m in doc["missing"])
                  + ". Re-run the same command to measure them (what was measured is kept).", ""]
    lines += _regime_markdown(results, doc.get("heldout_overlap"))
    lines += ["## Error over the held-out configurations", "",
              "| metric | median abs. error | p90 abs. error | configurations |",
              "|---|---|---|---|"]
    for k, s in doc["summary"].items():
        lines.append(f"| {LABELS[k]} | {_fmt(s['median_ape_pct'], 1)}% | "
                     f"{_fmt(s['p90_ape_pct'], 1)}% | {s['n']} |")
    lines += _noise_markdown(doc.get("round_spread") or {}, doc["summary"], doc.get("noise"))
    lines += ["", "![simulated vs measured](scatter.png)", "", "![error per configuration]"
              "(errors.png)", "", "## Every configuration", "",
              "measured / simulated (abs. error %). Overlap and entropy are the measured decode "
              f"routing's (held-out text: {_fmt(doc.get('heldout_overlap'), 3)}).", "",
              "| configuration | role | decode tok/s | step p50 ms | blocked ms/step | cold "
              "fraction | build ms/step | eval ms/step | overlap | entropy |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    rounds = (doc.get("rounds") or 1) > 1
    if rounds:
        lines[-2] = lines[-2] + " rounds' decode tok/s |"
        lines[-1] = lines[-1] + "---|"
    for r in results:
        cells = []
        for k in METRICS:
            m, s, e = r["measured"].get(k), r["simulated"].get(k), r["ape_pct"].get(k)
            cells.append(f"{_fmt(m)} / {_fmt(s)} ({_fmt(e, 0)}%)")
        spread = ""
        if rounds:
            far = round_spread_pct(r)
            spread = (" " + ", ".join(_fmt(v, 1) for v in r.get("rounds_decode_tok_s") or [])
                      + (f" (farthest {far:.0f}% off)" if far is not None else "") + " |")
        lines.append(f"| `{r['config']['name']}` | {r['config']['role']} | " + " | ".join(cells)
                     + f" | {_fmt(r['measured'].get('adjacent_overlap'), 3)} | "
                     f"{_fmt(r['measured'].get('load_entropy'), 3)} |" + spread)
    lines += _threads_markdown(results)
    if worst is not None:
        comp, diff = responsible(worst)
        lines += ["", f"## The worst configuration: `{worst['config']['name']}`", "",
                  f"Decode tok/s off by {_fmt(worst['ape_pct']['decode_tok_s'], 1)}%. "
                  f"The component responsible: **{LABELS[comp]}**, simulated "
                  f"{diff:+.2f} ms per step against measured. Per step (measured / simulated): "
                  + ", ".join(f"{LABELS[k]} {_fmt(worst['measured'].get(k))} / "
                              f"{_fmt(worst['simulated'].get(k))}" for k in COMPONENTS) + ".",
                  "", "![measured and simulated timelines](worst-timeline.png)", ""]
    misses = [r for r in results if r["config"]["role"] == "held-out"
              and (r["ape_pct"].get("decode_tok_s") or 0) > 10]
    if misses:
        lines += ["## Where the simulator misses (decode tok/s off by more than 10%)", "",
                  "| configuration | decode error | component furthest off (sim - measured, "
                  "ms/step) |", "|---|---|---|"]
        for r in sorted(misses, key=lambda r: -r["ape_pct"]["decode_tok_s"]):
            comp, diff = responsible(r)
            lines.append(f"| `{r['config']['name']}` | {_fmt(r['ape_pct']['decode_tok_s'], 1)}%"
                         f" | {LABELS[comp]} {diff:+.2f} |")
        lines.append("")
    lines += _gain_markdown(doc["gain"])
    lines += _probes_markdown(out)
    again = doc.get("resimulated")
    lines += ["## Reproduce", "", f"    {doc['command']}", "",
              *([f"then, on those traces, `{again['command']}`.", ""] if again else []),
              "Per-configuration results (with each capture's command and the settings `sim "
              "compare` derived) are in `results/`; the traces in `traces/` and the simulated "
              "traces in `simulated/` open with `ssdmoe trace summary` and export to Perfetto "
              "with `ssdmoe trace export`.", ""]
    return "\n".join(lines)


def _threads_markdown(results: list[dict]) -> list[str]:
    """A decode step's CPU by thread, measured / simulated (validation.thread_errors), and each
    thread's median signed error where it measured at least MIN_MS a step; nothing where the
    traces did not record the readers' CPU."""
    rows = [(r["config"]["name"], complete_split(r["measured"]), complete_split(r["simulated"]))
            for r in results]
    rows = [(n, m, s) for n, m, s in rows if m is not None and s is not None]
    if not rows:
        return []
    lines = ["", "## CPU a decode step by thread", "",
             "measured / simulated ms: MLX's compute thread (the process less the others), the "
             "main thread, the reader threads (each trace's cpu_ns, main_cpu_ns, reader_cpu_ns).",
             "", "| configuration | " + " | ".join(THREADS) + " |", "|---|---|---|---|"]
    lines += [f"| `{n}` | " + " | ".join(f"{m[t]:.2f} / {s[t]:.2f}" for t in THREADS) + " |"
              for n, m, s in rows]
    errors = signed_errors((m, s) for _, m, s in rows)
    medians = [f"{t} {e['median_signed_error_pct']:+.1f}% ({e['points']})"
               for t, e in errors.items() if e["median_signed_error_pct"] is not None]
    return [*lines, "", "Median signed error, simulated against measured (configurations): "
            + ", ".join(medians) + "."]


def _noise_markdown(spread: dict, summary: dict, noise: dict | None = None) -> list[str]:
    """One paragraph: how noisy the measured side was, beside the errors it is compared with;
    with `noise` (validation.noise), what redrawing the rounds makes of the summary figures."""
    med, p90 = spread.get("median_pct"), spread.get("p90_pct")
    if med is None:
        return []
    err = (summary.get("decode_tok_s") or {}).get("median_ape_pct")
    lines = ["", f"Measurement noise: a held-out configuration's farthest round lies a median "
             f"{med:.1f}% (p90 {_fmt(p90, 1)}%, {spread['n']} configurations) from its rounds' "
             "median decode tok/s. The figures compared are medians over the rounds, so they "
             "are steadier than one round, but a decode error of that size cannot be told "
             "from the machine's drift."]
    if err is not None and med > err:
        lines[-1] += f" This run's median decode error ({err:.1f}%) is inside that noise."
    if med > 5.0:
        lines[-1] += (" The noise exceeds the decode median target (5%): on this run that "
                      "target can be neither met nor missed with confidence.")
    if noise:
        floor, sim = noise["floor"], noise["simulated"]

        def fig(d: dict, key: str) -> str:
            lo, hi = d[f"{key}_range_pct"]
            return f"{d[f'{key}_pct']:.1f}% ({lo:.1f}-{hi:.1f}%)"

        lines += ["", f"Redrawing each held-out configuration's rounds ({noise['draws']} "
                  f"bootstrap draws, `validation/noise.py`; medians over the draws, their 5-95% "
                  f"range in brackets): a simulator that had every configuration's median "
                  f"exactly would score a decode median error of {fig(floor, 'median')} and a "
                  f"p90 of {fig(floor, 'p90')}; this run's prediction scores "
                  f"{fig(sim, 'median')} and {fig(sim, 'p90')}. The calibration "
                  "configurations' rounds are not redrawn (each draw would need its own fit), "
                  "so the first pair is a lower bound on what noise alone gives."]
    return lines


def _probes_markdown(out: Path) -> list[str]:
    """The mechanism probes next to the report (their own scripts write the JSON), if run."""
    from contract.errors import read_json_object

    lines: list[str] = []
    gil = out / "gil_probe.json"
    if gil.is_file():
        g = read_json_object(gil)
        lines += [f"**A reader's cold bundle read while the main thread runs Python** "
                  f"(`gil_probe.py`, `{g['command']}`, {g['date']}): the engine reads a bundle "
                  "one pread per tensor slice and each takes the GIL back, so the simulator "
                  "takes it per slice (sim.loads); per load, as it did before, it misses "
                  "most of the wait. Median cold read, ms:", "",
                  "| main thread | realized busy / idle ms | measured | simulated, per slice | "
                  "simulated, per load |", "|---|---|---|---|---|"]
        for a in g["arms"]:
            spell = " / ".join(f"{v:.3f}" for v in a["main_busy_idle_ms"] or []) or "-"
            lines.append(f"| {a['arm']} | {spell} | {a['measured_ms']:.3f} | "
                         f"{a['simulated_per_slice_ms']:.3f} | {a['simulated_per_load_ms']:.3f} |")
        lines.append("")
    lead = out / "lead_probe.json"
    if lead.is_file():
        lp = read_json_object(lead)
        lines += [f"**The layer lead's evaluation, fill point by fill point** (`lead_probe.py`, "
                  f"`{lp['command']}`, {lp['date']}): the staged path with lead none and layer, "
                  "captured as `validate` does and replayed with the committed scenario; the "
                  "engine times each part of a fill point (engine.fill_points `phase_ns`). "
                  "Per decode step, ms, measured / simulated; phases in ms per fill point, "
                  "measured only:", "",
                  "| arm | tok/s | build | eval | blocked | start next | fill | gather | kick |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for a in lp["arms"]:
            m, s_, ph = a["measured"], a["simulated"], a["phases_ms"]
            pair = " | ".join(f"{m[k]:.2f} / {s_[k]:.2f}"
                              for k in ("build_ms", "eval_ms", "blocked_ms"))
            lines.append(f"| {a['arm']} | {m['decode_tok_s']:.1f} / {s_['decode_tok_s']:.1f} | "
                         f"{pair} | {ph['start_next']:.3f} | {ph['fill']:.3f} | "
                         f"{ph['gather']:.3f} | {ph['kick']:.3f} |")
        lines.append("")
    return ["## Mechanism probes", "", *lines] if lines else []


def _regime_markdown(results: list[dict], heldout: float | None) -> list[str]:
    """Is the decode routing of the captures the realistic regime? (overlap near held-out)"""
    native = [r for r in results if r["config"]["k"] == "native"
              and r["config"]["path"] not in ("staged-token", "staged-layer")]
    overlaps = [r["measured"]["adjacent_overlap"] for r in native
                if r["measured"].get("adjacent_overlap") is not None]
    entropies = [r["measured"]["load_entropy"] for r in native
                 if r["measured"].get("load_entropy") is not None]
    if not overlaps:
        return []
    line = (f"Decode routing of the configurations that route with the model's own routers at "
            f"its own K: adjacent-token overlap {min(overlaps):.3f}-{max(overlaps):.3f}, load "
            f"entropy {min(entropies):.3f}-{max(entropies):.3f}")
    if heldout is not None:
        ok = all(abs(o - heldout) <= 0.05 for o in overlaps)
        line += (f"; held-out teacher-forced overlap {heldout:.3f}: "
                 + ("every one within +-0.05" if ok else "**not all within +-0.05**"))
    return [line + ". (Greedy decoding repeats: `reports/routing-regime/`.)", ""]


def _gain_markdown(g: dict) -> list[str]:
    lines = ["## The prerouter's gain on real hardware", ""]
    arms = g.get("arms") or {}
    if arms:
        lines += [f"Page cache 1/4 of the expert bytes, reads throttled to "
                  f"{g['throttle'][:-4]} MB/s "
                  "(the kernel's block-I/O throttle), measured:", "",
                  "| arm | decode tok/s | MiB/step | loads/step | MiB/load | cold fraction | "
                  "cold MiB/step | blocked ms/step | blocked share of step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, a in arms.items():
            lines.append(f"| {name} | {_fmt(a['decode_tok_s'], 1)} | {_fmt(a['mib_per_step'], 3)}"
                         f" | {_fmt(a['loads_per_step'], 1)} | {_fmt(a['mib_per_load'], 3)} | "
                         f"{_fmt(a['cold_fraction'])} | {_fmt(a['cold_mib_per_step'], 3)} | "
                         f"{_fmt(a['blocked_ms_per_step'], 1)} | {_fmt(a['blocked_share'])} |")
        lines.append("")
        if "gain_over_on_demand" in g:
            lines.append(f"Token lead over on-demand: **{g['gain_over_on_demand']:.2f}x**.")
        if "gain_over_layer_lead" in g:
            lines.append(f"Token lead over layer lead (same token): "
                         f"**{g['gain_over_layer_lead']:.2f}x**.")
        lines.append("")
    if g.get("bounds"):
        lines += [f"Bound: token-lead decode >= {BOUND_SHARE} x 1 / max(compute step, cold "
                  "bytes per step "
                  f"/ bandwidth, cold loads per step x device latency / queue depth); compute "
                  f"step {_fmt(g['compute_step_ms'])} ms ({g['compute_source']}); bandwidth "
                  "the throttle's rate, else the profile's disk bandwidth.", "",
                  f"| configuration | measured tok/s | bound tok/s | ratio | holds (>= "
                  f"{BOUND_SHARE}) | "
                  "limited by |", "|---|---|---|---|---|---|"]
        for b in g["bounds"]:
            lines.append(f"| `{b['config']}` | {_fmt(b['measured_tok_s'], 1)} | "
                         f"{_fmt(b['bound_tok_s'], 1)} | {b['ratio']:.2f} | "
                         f"{'yes' if b['holds'] else '**no**'} | {b['limit']} |")
        lines.append("")
        for b in g["bounds"]:
            if not b["holds"]:
                lines += [f"Where the bound does not hold, `{b['config']}`: {b['between']}.", ""]
    return lines
