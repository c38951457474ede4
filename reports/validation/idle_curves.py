"""How much slower the engine steps after the process has idled (calibration.idle_probe), and
what the simulator takes from it (sim.idle_slowdown).

Per decode loop: each sleeping arm's steps after a sleep (the kernel's 32 ms average of
"a thread runs" there, and the step's build + eval over the same capture's steps further from
any sleep), the curve made from them, and each arm's two busy threads per decode step (CPU,
run-queue wait, timeslices).
`ssdmoe calibrate` runs the same probe; `--hardware` writes this run's curves into a hardware
profile (the keys `idle_util_points`, `idle_slowdown` and their `sync_` twins), for
re-predicting traces captured before calibrate measured them.

    uv run python reports/validation/idle_curves.py [--rounds 3] [--hardware PATH]

Prints a table per loop; writes idle_probe.json next to this file.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HERE = Path(__file__).resolve().parent
MODEL = ROOT / "models" / "tiny-trained-stream"


def set_key(path: Path, key: str, values: list[float], why: str) -> None:
    """`key = [...]  # why` in a hardware TOML (the line replaced, or added at the end)."""
    text = path.read_text()
    line = f"{key} = [{', '.join(f'{v:g}' for v in values)}]  # {why}"
    pattern = re.compile(rf"^{re.escape(key)}\s*=.*$", re.M)
    text = pattern.sub(lambda _: line, text) if pattern.search(text) else \
        text.rstrip("\n") + "\n" + line + "\n"
    path.write_text(text)


def main() -> int:
    from calibration.idle_probe import ARMS, ROUNDS, measure_idle_slowdown
    from contract.errors import BadInput, IOFault

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--hardware", type=Path, help="hardware profile to write the curves into")
    args = ap.parse_args()
    if args.rounds < 1:
        sys.exit(f"--rounds: must be >= 1, got {args.rounds}")
    if not (MODEL / "manifest.json").is_file():
        sys.exit(f"{MODEL}: no converted model (ssdmoe convert models/tiny-trained {MODEL})")
    if args.hardware is not None and not args.hardware.is_file():
        sys.exit(f"{args.hardware}: no such hardware profile")
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        curves = measure_idle_slowdown(MODEL, rounds=args.rounds)
    except (BadInput, IOFault) as err:  # one line, never a traceback
        sys.exit(str(err))
    if curves is None:
        sys.exit("idle probe: needs Linux (/proc/self/schedstat)")
    out: dict = {"command": "uv run python reports/validation/idle_curves.py"
                 + (f" --rounds {args.rounds}" if args.rounds != ROUNDS else ""),
                 "date": date, "arms": [list(a) for a in ARMS], "loops": {}}
    for loop, c in curves.items():
        print(f"\n{loop} loop ({c.preset} preset, {c.rounds} rounds)")
        print(f"{'sleep ms':>8} {'every':>5} {'step':>4} {'average':>7} {'slowdown':>8} "
              f"{'steps':>5}")
        for p in c.points:
            print(f"{p['sleep_ms']:8g} {p['every']:5d} {p['position']:4d} {p['util']:7.3f} "
                  f"{p['slowdown']:+8.3f} {p['steps']:5d}")
        print(f"curve: {c.util} -> {c.slowdown}")
        arms = []
        print(f"{'sleep ms':>8} {'every':>5} {'thread':>8} {'cpu ms':>7} {'runq ms':>7} "
              f"{'slices':>6}  (per decode step, medians over rounds)")
        for sleep_ms, every in ARMS:
            runs = [r for r in c.runs if (r.sleep_ms, r.every) == (sleep_ms, every)]
            row = {"sleep_ms": sleep_ms, "every": every}
            for t in ("main", "compute"):
                med = {k: statistics.median(r.threads[t][k] for r in runs)
                       for k in ("run_ms", "runqueue_ms", "switches")}
                row[t] = med
                print(f"{sleep_ms:8g} {every:5d} {t:>8} {med['run_ms']:7.2f} "
                      f"{med['runqueue_ms']:7.2f} {med['switches']:6.1f}")
            arms.append(row)
        out["loops"][loop] = {"preset": c.preset, "rounds": c.rounds, "points": c.points,
                              "idle_util_points": c.util, "idle_slowdown": c.slowdown,
                              "threads_per_step": arms}
        if args.hardware is not None:
            prefix = "sync_" if loop == "sync" else ""
            how = f"reports/validation/idle_curves.py, {date}, {loop} loop ({c.preset} preset)"
            set_key(args.hardware, f"{prefix}idle_util_points", c.util,
                    f"calibration.idle_probe ({how}): the kernel's 32 ms average of 'a thread "
                    "runs' at a step after a sleep")
            set_key(args.hardware, f"{prefix}idle_slowdown", c.slowdown,
                    "that step's build + eval over the same capture's steps further from any "
                    "sleep, less 1 (sim.idle_slowdown)")
    (HERE / "idle_probe.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {HERE / 'idle_probe.json'}"
          + (f"; curves into {args.hardware}" if args.hardware is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
