"""How long `mx.async_eval` blocks on MLX's CPU backend: it returns only once few enough
operations remain queued, so a long graph cannot be queued whole and the host must come back
to keep the compute thread fed (why engine.fill_points queues a step layer by layer).

Run: uv run python reports/bench/async_eval_blocking.py   (a few seconds; prints a table and
writes reports/bench/async-eval-blocking.json)"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

OUT = Path(__file__).with_name("async-eval-blocking.json")


def chain(a: mx.array, ops: int) -> mx.array:
    x = a
    for _ in range(ops // 2):  # two ops per link: a matmul and a scale
        x = (x @ a) * 0.01
    return x


def main(size: int = 192, lengths: tuple[int, ...] = (10, 20, 40, 80, 160, 320), reps: int = 5):
    a = mx.random.normal((size, size))
    mx.eval(a)
    mx.eval(chain(a, 40))  # warm-up
    rows = []
    for n in lengths:
        blocked, total = [], []
        for _ in range(reps):
            x = chain(a, n)
            t0 = time.perf_counter()
            mx.async_eval(x)
            t1 = time.perf_counter()
            mx.eval(x)
            t2 = time.perf_counter()
            blocked.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
        b, t = statistics.median(blocked), statistics.median(total)
        rows.append({"ops": n, "async_eval_ms": round(b, 3), "total_ms": round(t, 3),
                     "blocked_fraction": round(b / t, 3) if t else 0.0,
                     "ops_left_when_it_returns": round(n * (1 - b / t), 1) if t else 0.0})
    print("| ops queued | async_eval returns after (ms) | all done (ms) | fraction blocked |"
          " ops left when it returns |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ops']} | {r['async_eval_ms']:.3f} | {r['total_ms']:.3f} | "
              f"{r['blocked_fraction']:.2f} | {r['ops_left_when_it_returns']:.0f} |")
    OUT.write_text(json.dumps({"command": "uv run python reports/bench/async_eval_blocking.py",
                               "mlx": mx.__version__, "size": size, "reps": reps,
                               "loadavg": os.getloadavg(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
