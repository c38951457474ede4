"""What a wake-up costs when the woken thread's core has gone idle: two Python threads hand a
token back and forth (threading.Event), the main thread spinning GAP of work between hand-overs,
each arm in its own process, on one core and on two. Prints, per round trip (two wake-ups),
the wall time and the process's CPU beyond the work, and the function-call IPIs the machine
took (/proc/interrupts CAL, x86 Linux; None elsewhere); writes wake_cost.json.

A guest's idle loop polls for a while before it halts (cpuidle haltpoll: up to
guest_halt_poll_ns), and bare metal's idle states have exit latencies: past that, waking a
thread on the other core wakes the core too.

Usage: uv run python reports/cross-machine/wake_cost.py [--trips 2000]"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GAPS_US = (0, 50, 100, 200, 400, 1000)


def ipis() -> int | None:
    for line in Path("/proc/interrupts").read_text().splitlines():
        if line.split(":")[0].strip() == "CAL":
            return sum(int(x) for x in line.split(":")[1].split() if x.isdigit())
    return None


def arm(cores: list[int], gap_us: int, trips: int) -> dict:
    """One arm, in this process: `trips` round trips with `gap_us` of work before each."""
    os.sched_setaffinity(0, cores)
    go, back = threading.Event(), threading.Event()

    def partner() -> None:
        for _ in range(trips):
            go.wait()
            go.clear()
            back.set()

    thread = threading.Thread(target=partner)
    thread.start()
    gap_s = gap_us / 1e6
    ipi0, cpu0, wall0 = ipis(), time.process_time(), time.perf_counter()
    for _ in range(trips):
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            pass
        go.set()
        back.wait()
        back.clear()
    wall1, cpu1, ipi1 = time.perf_counter(), time.process_time(), ipis()
    thread.join()
    return {"cores": len(cores), "gap_us": gap_us,
            "wall_us": round(((wall1 - wall0) / trips - gap_s) * 1e6, 1),
            "cpu_us": round(((cpu1 - cpu0) / trips - gap_s) * 1e6, 1),
            "ipis": None if ipi0 is None else round((ipi1 - ipi0) / trips, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trips", type=int, default=2000)
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # "CORES:GAP", run in a child process
    args = ap.parse_args()
    if args.trips < 1:
        ap.error(f"--trips must be >= 1, got {args.trips}")
    if args.arm:
        cores, gap = args.arm.split(":")
        print(json.dumps(arm([int(c) for c in cores.split(",")], int(gap), args.trips)))
        return
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        raise SystemExit("wake_cost.py: needs two cores")
    rows = []
    for gap in GAPS_US:
        for cores in ([available[0]], available[:2]):
            run = subprocess.run([sys.executable, __file__, "--trips", str(args.trips), "--arm",
                                  f"{','.join(map(str, cores))}:{gap}"], capture_output=True,
                                 text=True)
            if run.returncode:
                last = (run.stderr.strip().splitlines() or ["no output"])[-1]
                raise SystemExit(f"wake_cost.py: the arm on cores {cores}, {gap} us: {last}")
            rows.append(json.loads(run.stdout))
    print("| work between hand-overs us | cores | wall us a round trip | CPU us | IPIs |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gap_us']} | {r['cores']} | {r['wall_us']} | {r['cpu_us']} | {r['ipis']} |")
    out = HERE / "wake_cost.json"
    out.write_text(json.dumps({"command": "uv run python reports/cross-machine/wake_cost.py "
                               f"--trips {args.trips}", "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(HERE.parents[1])}")


if __name__ == "__main__":
    main()
