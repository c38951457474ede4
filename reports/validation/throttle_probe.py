"""What the kernel's read throttle does to decode, beyond holding reads to its rate.

1. From the committed validation traces (no capture): per throttled configuration, the share of
   decode steps with a stall over 20 ms, measured and simulated (sim.token_bucket's blk-throttle
   model), those steps' blocked time and the evaluation of the steps without one.
2. Captures (Linux, root, for the throttle): the staged path at a 1/4 page cache, unthrottled
   and at 15 MB/s, arms rotated over rounds, each its own `ssdmoe capture` process that reads
   every thread's /proc schedstat (CPU, run-queue wait, timeslices) before and after. Per arm,
   the two busiest threads (graph building + fills, and MLX's compute thread); reader threads
   are gone when the run ends and are not counted; and the capture's decode steps' median
   build, eval and blocked ms. `--arms page-cache` pairs the hot path with every expert cached
   and with a 1/4 page cache instead (unthrottled): does decode's own work grow when reader
   threads read cold beside it? (writes throttle_probe-page-cache.json)
3. How long a thread takes to run once woken (a threading.Event ping-pong), back to back and
   after idle gaps, the other core idle or kept busy.

    uv run python reports/validation/throttle_probe.py [--rounds 2] [--no-capture]
        [--arms throttle|page-cache]

Prints a table per part; writes throttle_probe.json next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HERE = Path(__file__).resolve().parent
MODEL = ROOT / "models" / "tiny-trained-stream"
THROTTLED = ("hot-pc25-15mbps", "on-demand-pc25-15mbps", "staged-pc25-15mbps",
             "staged-layer-pc25-15mbps", "staged-token-pc25-15mbps", "on-demand-pc25-40mbps")
LONG_MS = 20.0
# --arms: (what every capture runs, {arm: its own options})
SETUPS = {
    "throttle": ("staged, 1/4 page cache", ["--preset", "staged", "--page-cache-fraction", "0.25"],
                 {"unthrottled": [], "15 MB/s": ["--read-mbps", "15"]}),
    "page-cache": ("hot, unthrottled", ["--preset", "hot"],
                   {"every expert cached": ["--page-cache-fraction", "1.0"],
                    "1/4 cached": ["--page-cache-fraction", "0.25"]}),
}
GAPS = ((0.0, False), (2.0, False), (20.0, False), (2.0, True))  # (idle ms, other core busy)


def stall_shares() -> dict[str, dict[str, float]]:
    import polars as pl

    from contract.errors import BadInput
    from traces.reader import read_trace

    out = {}
    for name in THROTTLED:
        row = {}
        for kind in ("traces", "simulated"):
            path = HERE / kind / name
            try:
                steps = read_trace(path).steps.filter(pl.col("phase") == "decode")
            except (BadInput, OSError) as err:
                sys.exit(str(err) if str(path) in str(err) else f"{path}: {err}")
            long = steps["blocked_ns"] > LONG_MS * 1e6
            row[f"{kind}_long_share"] = float(long.mean())
            row[f"{kind}_eval_ms_short_steps"] = float(
                steps.filter(~long)["eval_ns"].median() or 0) / 1e6
            row[f"{kind}_blocked_ms_long_steps"] = float(
                steps.filter(long)["blocked_ns"].median() or 0) / 1e6
        out[name] = row
    return out


def _schedstat() -> dict[str, tuple[str, int, int, int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            cpu, wait, n = map(int, Path(f"/proc/self/task/{tid}/schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        out[tid] = (name, cpu, wait, n)
    return out


def child(out: str, argv: list[str]) -> None:
    """Run `ssdmoe capture argv` in this process; write each thread's schedstat deltas."""
    from ssdmoe_cli.main import main as ssdmoe

    before = _schedstat()
    sys.argv = ["ssdmoe", "capture", *argv]
    try:
        ssdmoe()
    except SystemExit as done:
        if done.code:
            raise
    after = _schedstat()
    rows = []
    for tid, (name, cpu, wait, n) in after.items():
        _, cpu0, wait0, n0 = before.get(tid, (name, 0, 0, 0))
        rows.append({"thread": f"{name}:{tid}", "cpu_s": (cpu - cpu0) / 1e9,
                     "wait_s": (wait - wait0) / 1e9, "slices": n - n0})
    Path(out).write_text(json.dumps(sorted(rows, key=lambda r: -r["cpu_s"])[:2]))


def _step_medians(trace: Path) -> dict[str, float]:
    """The capture's decode steps: median build, eval and blocked ms."""
    import polars as pl

    from traces.reader import read_trace

    steps = read_trace(trace).steps.filter(pl.col("phase") == "decode")
    return {f"{c}_ms": float(steps[f"{c}_ns"].median() or 0) / 1e6
            for c in ("build", "eval", "blocked")}


def capture_arms(rounds: int, setup: str = "throttle") -> dict[str, list[dict]]:
    _, base, arms = SETUPS[setup]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                out = Path(tmp) / "threads.json"
                argv = [str(MODEL), "--out", str(Path(tmp) / "trace"), "--force", "--no-progress",
                        "--prompts", str(HERE / "prompts.jsonl"), "--max-tokens", "96",
                        "--temp", "1.0", "--seed", "0", *base, *arms[arm]]
                t0 = time.perf_counter()
                done = subprocess.run([sys.executable, __file__, "--child", str(out), *argv],
                                      capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"capture ({arm}) failed: "
                             f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
                results[arm].append({"wall_s": time.perf_counter() - t0,
                                     "threads": json.loads(out.read_text()),
                                     "steps": _step_medians(Path(tmp) / "trace")})
                print(f"  round {r + 1}/{rounds} {arm}: done", flush=True)
    return results


def _wake(gap_ms: float, busy: bool, n: int) -> list[float]:
    """n delays (us) from setting an Event to the waiting thread running, `gap_ms` apart."""
    ev, back, stop = threading.Event(), threading.Event(), threading.Event()
    lat: list[float] = []
    t_set = [0]

    def waiter() -> None:
        for _ in range(n):
            ev.wait()
            ev.clear()
            lat.append((time.perf_counter_ns() - t_set[0]) / 1e3)
            back.set()

    def spinner() -> None:
        while not stop.is_set():
            time.sleep(0)

    extra = threading.Thread(target=spinner) if busy else None
    if extra:
        extra.start()
    w = threading.Thread(target=waiter)
    w.start()
    for _ in range(n):
        time.sleep(gap_ms / 1e3)
        t_set[0] = time.perf_counter_ns()
        ev.set()
        back.wait()
        back.clear()
    w.join()
    stop.set()
    if extra:
        extra.join()
    return sorted(lat)


def wake_latency(n: int = 300) -> list[dict]:
    rows = []
    for gap_ms, busy in GAPS:
        lat = _wake(gap_ms, busy, n)
        rows.append({"idle_gap_ms": gap_ms, "other_core_busy": busy,
                     "wake_us_p50": statistics.median(lat), "wake_us_p90": lat[int(0.9 * n)]})
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-capture", action="store_true", help="parts 1 and 3 only")
    p.add_argument("--arms", choices=list(SETUPS), default="throttle",
                   help="the captures' two arms (part 2)")
    a = p.parse_args()
    if a.rounds < 1:
        sys.exit(f"--rounds: must be >= 1, got {a.rounds}")
    doc: dict = {"command": "uv run python reports/validation/throttle_probe.py"
                 + (f" --rounds {a.rounds}" if a.rounds != 2 else "")
                 + (" --no-capture" if a.no_capture else "")
                 + (f" --arms {a.arms}" if a.arms != "throttle" else ""),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    doc["stalls"] = stall_shares()
    print(f"1. share of steps with a stall over {LONG_MS:.0f} ms, their blocked ms, and the eval"
          " ms of the other steps (measured / simulated, medians)")
    for name, r in doc["stalls"].items():
        print(f"  {name:28} {r['traces_long_share']:.2f} / {r['simulated_long_share']:.2f}   "
              f"blocked {r['traces_blocked_ms_long_steps']:.1f} / "
              f"{r['simulated_blocked_ms_long_steps']:.1f}   "
              f"eval {r['traces_eval_ms_short_steps']:.2f} / "
              f"{r['simulated_eval_ms_short_steps']:.2f}")

    if not a.no_capture:
        if not MODEL.exists():
            sys.exit(f"{MODEL}: no such model (ssdmoe convert models/tiny-trained {MODEL})")
        print(f"2. {SETUPS[a.arms][0]}: the two busiest threads' schedstat per capture, and "
              "its decode steps' median build / eval / blocked ms")
        doc["threads"] = capture_arms(a.rounds, a.arms)
        for arm, runs in doc["threads"].items():
            for run in runs:
                cols = "; ".join(f"CPU {t['cpu_s']:.2f} s, run-queue wait {t['wait_s']:.2f} s, "
                                 f"{t['slices']} slices" for t in run["threads"])
                st = run["steps"]
                print(f"  {arm:20} wall {run['wall_s']:.1f} s: {cols}; steps "
                      f"{st['build_ms']:.2f} / {st['eval_ms']:.2f} / {st['blocked_ms']:.2f}")

    doc["wake"] = wake_latency()
    print("3. a woken thread's delay before it runs, us (p50 / p90)")
    for r in doc["wake"]:
        print(f"  idle gap {r['idle_gap_ms']:4.1f} ms, other core "
              f"{'busy' if r['other_core_busy'] else 'idle'}: {r['wake_us_p50']:.1f} / "
              f"{r['wake_us_p90']:.1f}")
    name = "throttle_probe.json" if a.arms == "throttle" else f"throttle_probe-{a.arms}.json"
    (HERE / name).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
