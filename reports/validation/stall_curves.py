"""What a main-thread stall at a fill costs beyond the stall, measured and simulated.

calibration.stall_probe's arms (every expert in the page cache, each expert read held for an
injected delay; arms rotated over rounds) in one decode loop (--loop: lookahead, the hot path;
sync, the on-demand path), with longer captures and more delays, and each capture replayed by
`sim compare` with the same delay held in every expert read (read_hold_ms: a wait that
takes no CPU and lets go of the GIL, as the probe's sleep does), on the validation's fitted
settings of that path's warm calibration configuration: once with this machine's hardware
profile as calibrated (the loop's stall curve, sim.stall_wake) and once with the curve taken
out. Per arm (medians over rounds): build, eval and blocked ms per decode step, measured and
simulated, and per step the CPU time, run-queue wait and timeslices of the main thread and
MLX's compute thread.

    uv run python reports/validation/stall_curves.py [--loop sync] [--delays 0,0.5,1,2,4]
        [--rounds 3]

Writes stall_probe.json (lookahead) or stall_probe-sync.json next to this file. Linux only
(schedstat).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from calibration.stall_probe import LOOP_PRESETS, StallRun, run_arms  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = ROOT / "models" / "tiny-trained-stream"
# each loop's warm calibration configuration: its fitted settings are replayed
CALIBRATION_CONFIG = {"lookahead": "hot-pcall-unthrottled", "sync": "on-demand-pcall-unthrottled"}
OWN_SETTINGS = ("k", "path", "lead", "lru_bytes", "readers", "lookahead", "help_reads", "gil",
                "lora", "o_direct")  # what each trace's own run.json sets
TOKENS = 48


def _no_curve(loop: str) -> list[str]:
    prefix = "sync_" if loop == "sync" else ""
    return [f"{prefix}{k}=" for k in ("stall_points_ms", "stall_wake_main_ms",
                                       "stall_wake_compute_ms")]


def fitted_settings(config: str) -> list[str]:
    """The validation's fitted `sim compare` settings of calibration configuration `config`,
    less what each replayed trace's own run.json sets."""
    doc = json.loads((HERE / "results" / f"{config}.json").read_text())
    return [s for s in doc["settings"] if s.split("=", 1)[0] not in OWN_SETTINGS]


def _settings(loop: str) -> list[str]:
    return fitted_settings(CALIBRATION_CONFIG[loop])


def _simulated(run: StallRun, settings: list[str], extra: list[str]) -> dict[str, float]:
    from sim.compare import compare
    from traces.reader import read_trace

    sim = compare(read_trace(run.trace),
                  sets=[*settings, f"read_hold_ms={run.delay_ms}", *extra])
    return {"build_ms": sim.extra["build_ms_per_step"], "eval_ms": sim.extra["eval_ms_per_step"],
            "blocked_ms": sim.simulated["blocked_ms_per_step"]}


def run(delays: list[float], rounds: int, loop: str) -> dict:
    settings = _settings(loop)
    rows: dict[str, list[dict]] = {str(d): [] for d in delays}
    with tempfile.TemporaryDirectory() as tmp:
        for r in run_arms(MODEL, delays, rounds, Path(tmp), tokens=TOKENS,
                          prompts=HERE / "prompts.jsonl", preset=LOOP_PRESETS[loop]):
            rows[str(r.delay_ms)].append({
                "measured": {"build_ms": r.build_ms, "eval_ms": r.eval_ms,
                             "blocked_ms": r.blocked_ms, "fills": r.fills},
                "simulated": _simulated(r, settings, []),
                "simulated_no_curve": _simulated(r, settings, _no_curve(loop)),
                "threads": r.threads})
    return {"command": "uv run python reports/validation/stall_curves.py "
                       + ("--loop sync " if loop == "sync" else "")
                       + f"--delays {','.join(f'{d:g}' for d in delays)} --rounds {rounds}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "model": str(MODEL.relative_to(ROOT)), "loop": loop,
            "preset": LOOP_PRESETS[loop], "tokens": TOKENS,
            "settings": settings, "arms": {d: _medians(v) for d, v in rows.items()},
            "rounds": rows}


def _medians(rounds: list[dict]) -> dict:
    return {side: {k: statistics.median(r[side][k] for r in rounds) for k in rounds[0][side]}
            for side in ("measured", "simulated", "simulated_no_curve")} | {
        "threads": {t: {k: statistics.median(r["threads"][t][k] for r in rounds)
                        for k in rounds[0]["threads"][t]} for t in ("main", "compute")}}


def _table(doc: dict) -> str:
    lines = ["| delay ms/load | build ms/step: measured / sim / sim without curve | eval | "
             "blocked | compute thread: CPU, run-queue wait ms/step, timeslices/step | main "
             "thread: same |", "|---|---|---|---|---|---|"]
    for d, a in doc["arms"].items():
        m, s, n, th = a["measured"], a["simulated"], a["simulated_no_curve"], a["threads"]
        cells = [f"{m[k]:.2f} / {s[k]:.2f} / {n[k]:.2f}"
                 for k in ("build_ms", "eval_ms", "blocked_ms")]
        cells += [f"{th[t]['run_ms']:.2f}, {th[t]['runqueue_ms']:.2f}, {th[t]['switches']:.0f}"
                  for t in ("compute", "main")]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loop", choices=sorted(LOOP_PRESETS), default="lookahead")
    p.add_argument("--delays", default="0,0.5,1,2,4")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    try:
        delays = sorted({float(x) for x in a.delays.split(",")} | {0.0})
    except ValueError:
        sys.exit(f"--delays {a.delays!r}: not a comma-separated list of milliseconds")
    if not Path("/proc/self/schedstat").is_file():
        sys.exit("stall_probe: needs Linux's /proc schedstat")
    if not (MODEL / "manifest.json").is_file():
        sys.exit(f"{MODEL}: no converted model (bash scripts/setup.sh builds it)")
    if a.rounds < 1:
        sys.exit(f"--rounds {a.rounds}: must be >= 1")
    doc = run(delays, a.rounds, a.loop)
    name = "stall_probe.json" if a.loop == "lookahead" else f"stall_probe-{a.loop}.json"
    (HERE / name).write_text(json.dumps(doc, indent=1) + "\n")
    print(_table(doc))


if __name__ == "__main__":
    main()
