"""Simulator speed: 1,000 decode steps of edge0-35b (40 layers, K=4) on one core, per arm
(pinned to one CPU, polars limited to one thread), and a 100-point sweep on two cores (the
local backend's worker processes). This benchmark is where the <= 5 s and <= 2 min targets are
checked (tests only check that such runs complete).

    uv run python reports/sim/speed.py        # prints the tables, writes speed.json and speed.md
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ["POLARS_MAX_THREADS"] = "1"
ALL_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sim.profiles import load_scenario  # noqa: E402
from sim.replay import run_scenario  # noqa: E402
from sim.routing_input import _SYNTHETIC  # noqa: E402

OUT = Path(__file__).resolve().parent
CASES = {
    "staged on demand (paper engine)": ["lead=none"],
    "staged, lead token (paper engine)": ["lead=token"],
    "staged, lead token, 2 readers": ["lead=token", "readers=2"],
    "hot, 2 readers": ["path=hot", "lead=none", "readers=2"],
    "staged, lead 2 layers, speculative": ["lead=layer", "lead_layers=2",
                                          "prediction_is_routing=false",
                                          "prediction_accuracy=0.7"],
    "hot, 2 readers, 2 shared cores, CPU compute": ["path=hot", "lead=none", "readers=2",
                                                    "cpu_cores=2", "compute_on_cpu=true"],
}
SWEEP_GRID = """name = "speed-100"
scenario = "paper-m2-16gb"
set = ["decode_steps=1000", "lead=token"]
[axes]
ram_gib = [14, 15, 16, 17, 18, 20, 24, 28, 32, 40]  # from where the M2 reserve and the weights fit
ssd_bandwidth_gbps = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]
"""


def sweep_seconds() -> tuple[float, int]:
    """Wall seconds of a 100-point grid (every pair of the two axes) on 2 worker processes."""
    import tempfile

    from sim.sweep import load_grid, run_grid

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speed-100.toml"
        path.write_text(SWEEP_GRID)
        grid = load_grid(path)
        assert len(grid.points()) == 100
        t0 = time.perf_counter()
        rows = run_grid(grid, workers=2)
        return time.perf_counter() - t0, sum(r.get("status") == "ok" for r in rows)


def main() -> None:
    load = [round(x, 2) for x in os.getloadavg()]  # a shared machine: other jobs slow us
    # Pinned here, not at import: the sweep's spawned workers import this module again, and
    # pinning there put both on one CPU (the 148-168 s sweeps reported before 2026-12-01 21:30)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(ALL_CPUS)[0]})
    rows = []
    for label, sets in CASES.items():
        walls, cores, routings, steps_s = [], [], [], []
        for _ in range(3):
            _SYNTHETIC.clear()  # each repeat generates its routing (a sweep reuses it)
            t0 = time.perf_counter()
            result = run_scenario(load_scenario("paper-m2-16gb", ["decode_steps=1000", *sets]))
            walls.append(time.perf_counter() - t0)
            cores.append(result.figures.sim_core_s)
            routings.append(result.figures.routing_s)
            steps_s.append(result.figures.sim_steps_per_s)
        row = {"case": label, "set": sets, "decode_steps": 1000,
               "wall_s_median": statistics.median(walls), "wall_s": walls,
               "core_s_median": statistics.median(cores),
               "routing_s_median": statistics.median(routings),
               "sim_steps_per_s_median": statistics.median(steps_s),
               "loads_per_step": result.metrics["loads_per_step"]}
        rows.append(row)
        print(f"{label:40s} wall {row['wall_s_median']:.2f} s  core {row['core_s_median']:.2f} s"
              f"  routing {row['routing_s_median']:.2f} s  "
              f"{row['sim_steps_per_s_median']:.0f} steps/s", flush=True)
    if hasattr(os, "sched_setaffinity"):  # the sweep runs on two cores
        os.sched_setaffinity(0, set(sorted(ALL_CPUS)[:2]))
    sweep_s, sweep_ok = sweep_seconds()
    print(f"100-point sweep on 2 cores: {sweep_s:.1f} s ({sweep_ok} points ok)")
    data = {"command": "uv run python reports/sim/speed.py", "scenario": "paper-m2-16gb",
            "sweep_100_points_s": sweep_s, "sweep_points_ok": sweep_ok,
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "generated_at": time.strftime("%Y-%m-%d %H:%M"), "one_core": True,
            "load_average": load, "rows": rows}
    (OUT / "speed.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = ["# Simulator speed: 1,000 decode steps of edge0-35b (40 layers, K=4), one core", "",
             f"`{data['command']}` ({data['generated_at']}, load average "
             f"{' '.join(map(str, load))} at the start; pinned to one CPU, polars 1 thread;"
             " median of 3). Wall = everything `run_scenario` does: synthetic routing, the SimPy",
             "run, building the trace tables and the summary. Target: <= 5 s (checked here, not",
             "by a timed unit test; raw figures in `speed.json`).", "",
             "| case | wall s | SimPy core s | routing s | simulated steps/s | loads/step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['wall_s_median']:.2f} | {r['core_s_median']:.2f} | "
                     f"{r['routing_s_median']:.2f} | {r['sim_steps_per_s_median']:.0f} | "
                     f"{r['loads_per_step']:.0f} |")
    lines += ["", f"A 100-point sweep (`paper-m2-16gb` prerouter, 1,000 decode steps per point, "
              f"RAM x SSD bandwidth 10 x 10) on 2 worker processes: {sweep_s:.1f} s "
              f"({sweep_ok} points ok). Target: <= 2 minutes. The points share one synthetic "
              "routing (same model, K and seed), which each worker generates once "
              "(sim.routing_input)."]
    (OUT / "speed.md").write_text("\n".join(lines) + "\n")
    print()
    print("\n".join(lines[-2 - len(rows):]))
    print(f"\nwrote {OUT / 'speed.json'} and {OUT / 'speed.md'}")


if __name__ == "__main__":
    main()
