"""The floor under a fill point: one round trip between the main thread and MLX's compute
thread.

A fill point (engine.fill_points) stops the compute thread at a router until the host has
the routed ids and has queued the gather: the compute thread signals the main thread (or the
main thread finds the ids ready), the host works, then it queues the gather and the compute
thread, which went to sleep on an empty queue, must be woken. However the host work is
trimmed, each fill point costs at least this hand-off, and an on-demand staged step has one
per MoE layer. This measures it on the machine at hand: `mx.eval` of a one-element op queued
on an idle stream (both wake-ups), and the host's own share (`async_eval` returning).

Run: uv run python reports/bench/roundtrip.py [--reps N] [--layers L --step-ms S]
(a few seconds). Prints a table and writes reports/bench/roundtrip.json; with --layers and
--step-ms (a resident step's time) it also prints the share of a step that L round trips
take."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

OUT = Path(__file__).with_name("roundtrip.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=6, help="fill points per step")
    ap.add_argument("--step-ms", type=float, default=5.2,
                    help="a resident decode step in ms (tiny-trained here: ~5.2)")
    args = ap.parse_args()
    x = mx.zeros((1,), dtype=mx.uint32)
    mx.eval(x)
    queue_us, trip_us = [], []
    with mx.stream(mx.new_stream(mx.cpu)):
        for i in range(args.reps + 100):
            y = x + 1
            t0 = time.perf_counter_ns()
            mx.async_eval(y)
            t1 = time.perf_counter_ns()
            mx.eval(y)
            t2 = time.perf_counter_ns()
            if i >= 100:  # warm-up excluded
                queue_us.append((t1 - t0) / 1e3)
                trip_us.append((t2 - t0) / 1e3)
            time.sleep(0.0002)  # let the compute thread go back to sleep, as at a fill point
    q = statistics.median(queue_us)
    trip = statistics.median(trip_us)
    p90 = statistics.quantiles(trip_us, n=10)[-1]
    share = args.layers * trip / (args.step_ms * 1e3)
    print("| measure | median us | p90 us |")
    print("|---|---|---|")
    print(f"| async_eval returns (host share) | {q:.1f} | "
          f"{statistics.quantiles(queue_us, n=10)[-1]:.1f} |")
    print(f"| queue + compute + result back (round trip) | {trip:.1f} | {p90:.1f} |")
    print(f"{args.layers} round trips per step = {args.layers * trip / 1e3:.2f} ms = "
          f"{100 * share:.1f}% of a {args.step_ms} ms step")
    OUT.write_text(json.dumps({
        "command": "uv run python reports/bench/roundtrip.py", "mlx": mx.__version__,
        "reps": args.reps, "loadavg": os.getloadavg(), "async_eval_us_median": q,
        "roundtrip_us_median": trip, "roundtrip_us_p90": p90, "layers": args.layers,
        "step_ms": args.step_ms, "share_of_step": share}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
