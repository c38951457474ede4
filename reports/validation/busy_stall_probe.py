"""Does a fill stalled with the host busy cost compute what one stalled with the host idle does?

calibration.stall_probe's captures in the lookahead loop (hot preset, every expert in the page
cache), each expert read held for a delay, two ways: asleep (the stall probe's own hold: a slow
device, every thread idle) and busy (the reading thread re-reads a warm 64 KiB range of the
model's resident file until the delay is up, letting the GIL go on every pread: a cold read's
kernel work, without the device), against no hold; arms rotated over rounds, paired by round.
Per arm (medians over rounds): build, eval and blocked ms per decode step, and per step the CPU
time and run-queue wait of the main thread and MLX's compute thread. Per hold and delay (the
growth over the no-hold capture of the same round, per fill that blocked; medians): the
stall, build and eval (calibration.stall_probe.curve_point, "step"), and the compute thread's
CPU and run-queue wait.

With --lead layer the captures run the staged path with the layer lead instead: with every
expert cached its reads are prefetches a reader thread does while compute runs, so a hold
there lies beside compute rather than in a stall.

Each capture is replayed by `sim compare` on the validation's fitted settings of the path's warm
calibration configuration, with the same hold in every expert read (read_hold_ms, and
read_hold_busy for the busy arms: CPU on the reading thread, the GIL let go). The simulator
reads its lookahead sleep curve (sim.stall_wake) at a stall's idle part and its busy curve
(calibrate's busy holds) at the busy part.

    uv run python reports/validation/busy_stall_probe.py [--delays 0.5,1] [--rounds 3]
        [--lead layer]

Writes busy_stall_probe.json (busy_stall_probe-layer.json with --lead layer) next to this
file. Linux only (schedstat).
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

from calibration.stall_probe import (  # noqa: E402
    HOLDS,
    LOOP_PRESETS,
    StallRun,
    capture,
    curve_point,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from stall_probe import _simulated, fitted_settings  # noqa: E402

MODEL = ROOT / "models" / "tiny-trained-stream"
# the warm calibration configuration whose fitted settings each lead's replays take
CALIBRATION_CONFIG = {"none": "hot-pcall-unthrottled", "layer": "staged-layer-pcall-unthrottled"}


def arms(delays: list[float]) -> list[tuple[str, float]]:
    return [("sleep", 0.0), *((hold, d) for d in delays for hold in HOLDS)]


def per_arm(runs: list[StallRun], hold: str, delay: float,
            simulated: dict[int, dict[str, float]]) -> dict[str, float]:
    mine = [r for r in runs if r.hold == hold and r.delay_ms == delay]
    out = {k: statistics.median(getattr(r, k) for r in mine)
           for k in ("build_ms", "eval_ms", "blocked_ms", "fills")}
    for k in ("build_ms", "eval_ms", "blocked_ms"):
        out[f"simulated_{k}"] = statistics.median(simulated[id(r)][k] for r in mine)
    for t in ("main", "compute"):
        for k in ("run_ms", "runqueue_ms"):
            out[f"{t}_{k}"] = statistics.median(r.threads[t][k] for r in mine)
    return out


def growth(runs: list[StallRun], hold: str, delay: float) -> dict[str, float]:
    """Per fill that blocked, over the same round's no-hold capture (medians)."""
    paired = [r for r in runs if r.delay_ms == 0 or r.hold == hold]
    stall, build, evaluate = curve_point(paired, delay, "step")
    base = [r for r in runs if r.delay_ms == 0]
    held = [r for r in runs if r.hold == hold and r.delay_ms == delay]
    compute = {k: statistics.median((h.threads["compute"][k] - b.threads["compute"][k]) / h.fills
                                    for b, h in zip(base, held, strict=True))
               for k in ("run_ms", "runqueue_ms")}
    return {"stall_ms": stall, "build_ms": build, "eval_ms": evaluate,
            "compute_cpu_ms": compute["run_ms"], "compute_runqueue_ms": compute["runqueue_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", default="0.5,1", help="holds per expert read, ms")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--lead", choices=("none", "layer"), default="none",
                    help="layer: the staged path with the layer lead (reads beside compute)")
    args = ap.parse_args()
    preset, extra = ((LOOP_PRESETS["lookahead"], ()) if args.lead == "none"
                     else ("staged", ("--lead", "layer")))
    try:
        delays = sorted({float(d) for d in args.delays.split(",")} - {0.0})
    except ValueError:
        sys.exit(f"--delays {args.delays!r}: not a comma-separated list of milliseconds")
    if not delays or min(delays) < 0:
        sys.exit(f"--delays {args.delays!r}: give holds > 0 ms (no hold is always an arm)")
    if args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: must be >= 1")
    if not Path("/proc/self/schedstat").is_file():
        sys.exit("busy_stall_probe: needs Linux's /proc schedstat")
    if not (MODEL / "manifest.json").is_file():
        sys.exit(f"{MODEL}: no converted model (bash scripts/setup.sh builds it)")
    fitted = HERE / "results" / f"{CALIBRATION_CONFIG[args.lead]}.json"
    if not fitted.is_file():
        sys.exit(f"{fitted}: no fitted settings to replay with (run ssdmoe validate first)")
    order = arms(delays)
    runs: list[StallRun] = []
    with tempfile.TemporaryDirectory(prefix="ssdmoe-busy-stall-") as tmp:
        for r in range(args.rounds):
            for hold, d in order[r % len(order):] + order[:r % len(order)]:
                runs.append(capture(MODEL, d, Path(tmp) / f"{hold}{d}-round{r}",
                                    tokens=args.tokens, preset=preset, hold=hold,
                                    extra=extra))
                print(f"round {r + 1}/{args.rounds} {hold} {d} ms: eval "
                      f"{runs[-1].eval_ms:.2f} ms/step", flush=True)
        settings = fitted_settings(CALIBRATION_CONFIG[args.lead])
        simulated = {id(r): _simulated(r, settings, ["read_hold_busy=true"]
                                       if r.hold == "busy" else []) for r in runs}
    table = {f"{hold} {d:g}": per_arm(runs, hold, d, simulated) for hold, d in order}
    grown = {f"{hold} {d:g}": growth(runs, hold, d) for hold, d in order[1:]}
    print("\nms per step, measured / simulated: build, eval, blocked; compute cpu / run-queue")
    for name, a in table.items():
        print(f"{name:10s} " + "  ".join(f"{a[k]:5.2f} / {a['simulated_' + k]:5.2f}"
                                         for k in ("build_ms", "eval_ms", "blocked_ms"))
              + f"   {a['compute_run_ms']:6.2f} / {a['compute_runqueue_ms']:5.2f}")
    print("\nper fill that blocked, over no hold: stall, build, eval, compute cpu, run-queue ms")
    for name, g in grown.items():
        print(f"{name:10s} " + "  ".join(f"{g[k]:6.3f}" for k in g))
    lead = "" if args.lead == "none" else f" --lead {args.lead}"
    doc = {"command": "uv run python reports/validation/busy_stall_probe.py "
                      f"--delays {args.delays} --rounds {args.rounds}{lead}",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(MODEL),
           "preset": preset, "lead": args.lead, "tokens": args.tokens, "rounds": args.rounds,
           "settings": settings, "arms": table, "growth_per_fill": grown,
           "runs": [{"hold": r.hold, "delay_ms": r.delay_ms, "build_ms": r.build_ms,
                     "eval_ms": r.eval_ms, "blocked_ms": r.blocked_ms, "fills": r.fills,
                     "threads": r.threads} for r in runs]}
    name = "busy_stall_probe.json" if args.lead == "none" else f"busy_stall_probe-{args.lead}.json"
    (HERE / name).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
