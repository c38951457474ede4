"""Summarise `cores.sh`'s captures: measured figures per round, each trace replayed by `sim
compare` on the given profiles, and what the cold reads cost per step (a 1/4 page cache less
all of it) on one core and on two. Writes cores.json beside this script.

Usage (cores.sh runs it): uv run python reports/cross-machine/cores.py CAPTURES ROUNDS PROFILES"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from reports.load_script import load_script  # noqa: E402
from sim.compare import measured_split  # noqa: E402
from traces.reader import read_trace  # noqa: E402
from traces.summary import summarize  # noqa: E402

ARMS = ("two-quarter", "one-quarter", "two-all", "one-all")
FIGURES = ("decode_tok_s", "cpu_ms_per_step", "main_cpu_ms_per_step", "eval_ms_per_step")


def time_figure(text: str, label: str) -> float:
    """One figure of GNU time's -v output."""
    return float(re.search(rf"{re.escape(label)}: ([\d.]+)", text).group(1))


def measured_figures(trace_dir: Path) -> dict:
    """The trace's summary, with build and evaluation per decode step (as repredict reads
    them off the simulated trace)."""
    trace = read_trace(trace_dir)
    return dict(summarize(trace), **measured_split(trace))


def rows(captures: Path, rounds: int, profiles: Path) -> list[dict]:
    repredict = load_script("cross-machine/repredict.py")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        scenario = repredict.scenario_file(profiles.resolve(), Path(tmp))
        for r in range(rounds):
            for arm in ARMS:
                trace = captures / f"{arm}.r{r}"
                measured = measured_figures(trace)
                simulated = repredict.simulated_figures(trace, scenario, Path(tmp) / "sim")
                timing = (captures / f"{arm}.r{r}.time").read_text()
                ipis = captures / f"{arm}.r{r}.ipis"
                cores, cache = arm.split("-")
                out.append({
                    "round": r, "cores": 1 if cores == "one" else 2,
                    "page_cache": "1/4" if cache == "quarter" else "all",
                    "measured": {k: round(measured[k], 3) for k in FIGURES},
                    "simulated": {k: round(simulated[k], 3) for k in FIGURES},
                    "system_s": time_figure(timing, "System time (seconds)"),
                    "voluntary_switches": int(time_figure(timing, "Voluntary context switches")),
                    "involuntary_switches": int(time_figure(timing,
                                                            "Involuntary context switches")),
                    "function_call_ipis": int(ipis.read_text()) if ipis.is_file() else None})
    return out


def cold_read_cost(table: list[dict], cores: int, side: str, key: str) -> float:
    """Median over rounds of (1/4 page cache - all cached) of one figure, paired by round."""
    diffs = []
    for r in sorted({x["round"] for x in table}):
        pick = {x["page_cache"]: x[side][key] for x in table
                if x["round"] == r and x["cores"] == cores}
        diffs.append(pick["1/4"] - pick["all"])
    return statistics.median(diffs)


def main() -> None:
    captures, rounds, profiles = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    table = rows(captures, rounds, profiles)
    print("| round | cores | page cache | decode tok/s m / s | CPU ms/step m / s | main-thread CPU "
          "ms/step m / s | eval ms/step m / s | system s | voluntary / involuntary switches | "
          "function-call IPIs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in table:
        m, s = x["measured"], x["simulated"]
        cells = " | ".join(f"{m[k]:.2f} / {s[k]:.2f}" for k in FIGURES)
        print(f"| {x['round']} | {x['cores']} | {x['page_cache']} | {cells} | {x['system_s']} | "
              f"{x['voluntary_switches']} / {x['involuntary_switches']} | "
              f"{x['function_call_ipis']} |")
    summary = {}
    for cores in (2, 1):
        for key in ("cpu_ms_per_step", "eval_ms_per_step"):
            m = cold_read_cost(table, cores, "measured", key)
            s = cold_read_cost(table, cores, "simulated", key)
            summary[f"cores{cores}_{key}"] = {"measured": round(m, 3), "simulated": round(s, 3)}
            print(f"{cores} core(s): the cold reads add {m:+.2f} ms of {key[:-12]} a step "
                  f"measured, {s:+.2f} simulated (1/4 page cache less all cached, median of "
                  "paired rounds)")
    out = HERE / "cores.json"
    out.write_text(json.dumps({"command": f"bash reports/cross-machine/cores.sh {rounds}",
                               "profiles": str(profiles), "rows": table,
                               "cold_reads_cost": summary}, indent=1) + "\n")
    print(f"wrote {out.relative_to(HERE.parents[1])}")


if __name__ == "__main__":
    main()
