"""Validate the simulator against measured traces: `sim compare` on every sample trace.

    uv run python reports/validation/generate.py [TRACE_DIR ...]
    # default: traces/samples/* and reports/validation/traces/*

Writes reports/validation/README.md and validation.json. Each row is exactly what
`uv run ssdmoe sim compare TRACE --json` prints (default scenario resolution: this machine's
calibrated profile, the trace's model profile, the trace's own engine configuration and routing).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sim.compare import compare  # noqa: E402
from ssdmoe_cli.errors import BadInput  # noqa: E402
from traces.reader import read_trace  # noqa: E402

OUT = Path(__file__).resolve().parent
KEYS = ("decode_tok_s", "step_ms_p10", "step_ms_p50", "step_ms_p90", "blocked_ms_per_step",
        "cold_fraction", "loads_per_step", "mib_per_step", "prefill_tok_s")


def traces(args: list[str]) -> list[Path]:
    if args:
        return [Path(a) for a in args]
    found = []
    for where in (ROOT / "traces" / "samples", OUT / "traces"):
        found += sorted(p.parent for p in where.glob("*/run.json"))
    return found


def row(path: Path) -> dict[str, Any]:
    try:
        return _row(path)
    except BadInput as err:  # a trace that cannot be replayed is reported, not skipped
        return {"trace": str(path), "error": str(err)}


def _row(path: Path) -> dict[str, Any]:
    trace = read_trace(path)
    t0 = time.perf_counter()
    c = compare(trace)
    d = c.to_dict()
    engine = trace.run.get("engine") or {}
    d["engine"] = {k: engine.get(k) for k in ("preset", "decode", "readers", "page_cache_budget",
                                              "o_direct", "hot_bytes", "staged_headroom",
                                              "lookahead", "prerouter")}
    # which decode loop the sim ran (sim.compare: lookahead only for staged traces recording it)
    d["sim_loop"] = "lookahead" if c.scenario.lookahead else "synchronous"
    d["decode_steps"] = c.extra["decode_steps"]
    d["started"] = trace.run.get("started_at")
    d["sim_s"] = time.perf_counter() - t0
    try:
        d["trace"] = str(path.resolve().relative_to(ROOT))
    except ValueError:
        d["trace"] = str(path)
    return d


def fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def pct(v: Any) -> str:
    return "-" if v is None else f"{v:+.0f}%"


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ("| trace | engine | decode tok/s meas / sim (err) | step ms p10 meas / sim (err) | "
            "step ms p50 meas / sim (err) | blocked ms/step meas / sim (err) | "
            "cold fraction meas / sim | loads/step meas / sim |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['trace']}` | failed: {r['error']} |" + " |" * 6)
            continue
        m = r["metrics"]
        e = r["engine"]
        eng = f"{e.get('preset') or e.get('decode')}"
        if e.get("prerouter"):
            eng += " + prerouter heads"
        if e.get("page_cache_budget"):
            eng += f", page cache {e['page_cache_budget'] / 2**20:.1f} MiB"
        if e.get("o_direct"):
            eng += ", O_DIRECT"
        if r.get("sim_loop") == "lookahead":
            eng += ", lookahead"

        def pair(key: str, digits: int = 2, err: bool = False, m: dict = m) -> str:
            x = m[key]
            text = f"{fmt(x['measured'], digits)} / {fmt(x['simulated'], digits)}"
            return text + (f" ({pct(x['error_pct'])})" if err else "")

        lines.append(f"| `{r['trace']}` | {eng} | {pair('decode_tok_s', 1, True)} | "
                     f"{pair('step_ms_p10', 1, True)} | {pair('step_ms_p50', 1, True)} | "
                     f"{pair('blocked_ms_per_step', 2, True)} | {pair('cold_fraction', 3)} | "
                     f"{pair('loads_per_step', 1)} |")
    return lines


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [r for r in rows if "error" not in r]
    out: dict[str, Any] = {}
    for key in KEYS:
        errs = [abs(r["metrics"][key]["error_pct"]) for r in rows
                if r["metrics"][key]["error_pct"] is not None]
        out[key] = {"median_abs_error_pct": statistics.median(errs) if errs else None,
                    "max_abs_error_pct": max(errs) if errs else None, "n": len(errs)}
    # a fraction near 0 has no useful relative error: the absolute difference instead
    diffs = [abs(r["metrics"]["cold_fraction"]["simulated"] - r["metrics"]["cold_fraction"][
        "measured"]) for r in rows if None not in (r["metrics"]["cold_fraction"]["simulated"],
                                                   r["metrics"]["cold_fraction"]["measured"])]
    out["cold_fraction"] = {"median_abs_difference": statistics.median(diffs) if diffs else None,
                            "max_abs_difference": max(diffs) if diffs else None, "n": len(diffs)}
    inside = 0
    for r in rows:
        m = r["metrics"]
        sim = m["step_ms_p50"]["simulated"]
        lo, hi = m["step_ms_p10"]["measured"], m["step_ms_p90"]["measured"]
        if None not in (sim, lo, hi) and lo <= sim <= hi:
            inside += 1
    out["sim_step_within_measured_p10_p90"] = f"{inside}/{len(rows)}"
    return out


def main() -> None:
    paths = traces(sys.argv[1:])
    if not paths:
        raise SystemExit("no traces (traces/samples/*/run.json); pass trace directories")
    t0 = time.time()
    rows = [row(p) for p in paths]
    hw = json.loads((ROOT / "reports" / "calibration" / "this-machine.json").read_text()) \
        if (ROOT / "reports" / "calibration" / "this-machine.json").is_file() else {}
    data = {"generated": time.strftime("%Y-%m-%d %H:%M"), "command":
            "uv run python reports/validation/generate.py " + " ".join(sys.argv[1:]),
            "calibration": {k: hw.get(k) for k in ("when", "command", "hardware")},
            "summary": summary(rows), "traces": rows}
    (OUT / "validation.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    s = data["summary"]
    lines = [
        "# Simulator vs measured: sim compare on the sample traces",
        "",
        f"Generated by `{data['command'].strip()}` ({data['generated']}, "
        f"{time.time() - t0:.0f} s); every row is `uv run ssdmoe sim compare TRACE --json` "
        "(numbers also in `validation.json`).",
        "",
        "Scenario per trace: this machine's calibrated profile "
        "(`scenarios/hardware/this-machine.toml`, written by "
        f"`{(hw.get('command') or 'ssdmoe calibrate').strip()}`"
        + (f" at {hw['when']}" if hw.get("when") else "") + "), the trace's model profile "
        "(`scenarios/models/tiny-trained.toml`, from its manifest) through "
        "`scenarios/this-machine-tiny-trained.toml`, and the trace's own engine configuration "
        "(run.json `engine`: preset -> policy/LRU/readers, K, page-cache budget, O_DIRECT, "
        "decode loop: lookahead for staged traces that recorded it, else synchronous) and "
        "routing. Nothing was fitted to these traces.",
        "",
        *table(rows),
        "",
        "err = simulated / measured - 1. decode tok/s is `trace summary`'s (decode tokens / "
        "decode wall time, so slow outlier steps weigh in); the sim's steps are nearly "
        "constant, so compare its step time with the measured p10-p50 band too.",
        "",
        "Median |error| over the traces: " + ", ".join(
            f"{k} {fmt(v['median_abs_error_pct'], 0)}%" for k, v in s.items()
            if isinstance(v, dict) and v.get("median_abs_error_pct") is not None)
        + f"; cold_fraction |sim - measured| median "
        f"{fmt(s['cold_fraction']['median_abs_difference'], 3)} (max "
        f"{fmt(s['cold_fraction']['max_abs_difference'], 3)}, the O_DIRECT row: a definition "
        "difference, see below). "
        f"Simulated step time within the measured p10-p90 band: "
        f"{s['sim_step_within_measured_p10_p90']} traces.",
        "",
    ]
    notes = sorted({n for r in rows for n in r.get("notes", [])})
    if notes:
        lines += ["Notes `sim compare` printed:", ""] + [f"- {n}" for n in notes] + [""]
    discussion = OUT / "discussion.md"
    if discussion.is_file():
        lines += [discussion.read_text().rstrip(), ""]
    (OUT / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
