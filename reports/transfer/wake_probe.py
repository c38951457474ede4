"""Where the quota machine's extra CPU goes: the main thread's CPU while MLX's `async_eval`
holds it (the CPU stream's bounded queue) and while `.item()` waits, per operation, on one core
against two. Run through the CLI's BLAS (engine.blas), once per core set:

    for c in 0 0,1; do taskset -c $c uv run python reports/transfer/wake_probe.py; done

Prints one JSON line per run (reports/transfer/quota-cpu.md has the table)."""

from __future__ import annotations

import json
import os
import statistics
import time

from engine.blas import reexec_with_fast_blas

reexec_with_fast_blas()  # re-executes with OpenBLAS preloaded, as every ssdmoe command runs

import mlx.core as mx  # noqa: E402  (after the re-exec)

A = mx.random.normal((128, 128))
mx.eval(A)


def graph(ops: int) -> mx.array:
    """`ops` small dependent operations (a decode step is hundreds of them)."""
    x = A
    for _ in range(ops):
        x = mx.tanh(x @ A * 0.01)
    return x


def once(ops: int) -> dict[str, float]:
    y = graph(ops)
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    mx.async_eval(y)  # blocks until little is left queued (the CPU stream's bounded queue)
    c1 = time.thread_time()
    y.sum().item()  # waits for the rest
    return {"wall_ms": 1e3 * (time.perf_counter() - t0),
            "main_cpu_async_eval_ms": 1e3 * (c1 - c0),
            "main_cpu_item_wait_ms": 1e3 * (time.thread_time() - c1),
            "process_cpu_ms": 1e3 * (time.process_time() - p0)}


def main() -> None:
    out: dict = {"cores": sorted(os.sched_getaffinity(0)), "runs": {}}
    for ops in (100, 400):
        for _ in range(5):
            once(ops)
        runs = [once(ops) for _ in range(30)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        med["main_cpu_async_eval_us_per_op"] = 1e3 * med["main_cpu_async_eval_ms"] / ops
        med["op_us"] = 1e3 * med["wall_ms"] / ops
        out["runs"][ops] = med
    print(json.dumps(out))


if __name__ == "__main__":
    main()
