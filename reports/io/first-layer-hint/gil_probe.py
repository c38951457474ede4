"""How long a woken reader thread waits for the main thread's Python: the start delay of a
read handed to an idle reader when the main thread keeps running Python after the hand-over.

Six threads block on a queue.SimpleQueue, as engine.readers' do. The main thread puts a
timestamp, then runs a pure-Python loop for B ms (as it does after queueing the token lead's
reads: the step's record, the next step's graph), then sleeps 2 ms; the reader that gets the
item records put -> its get() returning. 200 hand-overs per B. Two variants at B = 1 ms: the
main thread calls time.sleep(0) right after the put (it lets go of the interpreter lock once),
and a switch interval of 0.1 ms instead of CPython's 5 ms.

Usage: uv run python reports/io/first-layer-hint/gil_probe.py; writes gil-probe.json beside
this script."""

from __future__ import annotations

import json
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROUNDS = 200


def busy(ms: float) -> None:
    end = time.perf_counter_ns() + ms * 1e6
    while time.perf_counter_ns() < end:
        pass


def start_delays(q: queue.SimpleQueue, got: list[int], busy_ms: float, yield_after: bool
                 ) -> dict:
    got.clear()
    for _ in range(ROUNDS):
        q.put(time.perf_counter_ns())
        if yield_after:
            time.sleep(0)
        busy(busy_ms)
        time.sleep(0.002)
    us = sorted(v / 1e3 for v in got)
    return {"median_us": statistics.median(us), "p90_us": us[int(0.9 * len(us))]}


def main() -> None:
    q: queue.SimpleQueue = queue.SimpleQueue()
    got: list[int] = []

    def reader() -> None:
        while (t := q.get()) is not None:
            got.append(time.perf_counter_ns() - t)

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    rows = {f"main runs Python {b} ms after the put": start_delays(q, got, b, False)
            for b in (0.0, 0.5, 1.0, 2.0)}
    rows["1 ms, time.sleep(0) after the put"] = start_delays(q, got, 1.0, True)
    sys.setswitchinterval(1e-4)
    rows["1 ms, switch interval 0.1 ms"] = start_delays(q, got, 1.0, False)
    for _ in threads:
        q.put(None)
    doc = {"command": "uv run python reports/io/first-layer-hint/gil_probe.py",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "python": sys.version.split()[0], "start_delay": rows}
    (HERE / "gil-probe.json").write_text(json.dumps(doc, indent=1) + "\n")
    for name, r in rows.items():
        print(f"{name:40s} reader starts after {r['median_us']:7.0f} us (p90 {r['p90_us']:.0f})")


if __name__ == "__main__":
    main()
