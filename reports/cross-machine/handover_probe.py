"""What handing work to MLX's compute thread costs per operation, with the two threads on two
cores and on one. A decode step, reduced to its hand-overs: chains of small element-wise
operations (no BLAS), handed over with `mx.async_eval` in 6 pieces per step as the engine's
fill points do, then one `mx.eval`. Each arm is its own process; the one-core arm pins itself
to core 0 (sched_setaffinity: no root), the other runs on every core. Arms rotate over rounds.

Per step: wall ms, the main thread's CPU, the process's user and system CPU, and context
switches (getrusage). `ops` is the chain's links per piece, y = tanh(y * a + b), each five MLX
primitives (two broadcasts, multiply, add, tanh: counted from the graph, mx.export_to_dot);
above MLX's bound of 10 tasks in flight the main thread waits for the compute thread between
them. With `--model`, the primitives of one resident decode step of that mlx-lm checkpoint are
counted the same way: what the per-primitive difference comes to per step.

Usage: uv run python reports/cross-machine/handover_probe.py [--rounds 3] [--model
models/tiny-trained]; writes
handover_probe.json beside this script."""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIECES = 6
STEPS = 400


def primitives(*outputs) -> int:
    """MLX primitives in the (unevaluated) graph of `outputs`."""
    import tempfile

    import mlx.core as mx

    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return len(re.findall(r'label ="\w+", shape=rectangle', Path(f.name).read_text()))


def chain(y, ops: int):
    import mlx.core as mx

    for _ in range(ops):
        y = mx.tanh(y * 1.0001 + 0.001)
    return y


def decode_step_primitives(model_dir: str) -> int:
    """Primitives of one decode step (one token after a short prompt) of an mlx-lm checkpoint,
    held resident."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(model_dir)
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokenizer.encode("def main():")]), cache=cache)
    mx.eval(logits)
    return primitives(model(mx.argmax(logits[:, -1:], axis=-1), cache=cache))


def measure(ops: int) -> dict[str, float]:
    """One arm, in this process: per-step figures over STEPS steps after 50 of warm-up."""
    import mlx.core as mx

    x = mx.ones((256,))
    mx.eval(x)

    def step() -> None:
        y = x
        for _ in range(PIECES):
            y = chain(y, ops)
            mx.async_eval(y)
        mx.eval(y)

    for _ in range(50):
        step()
    r0, m0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    for _ in range(STEPS):
        step()
    t1, m1, r1 = time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_SELF)
    per = 1e3 / STEPS
    return {"primitives_per_step": PIECES * primitives(chain(x, ops)),
            "wall_ms": (t1 - t0) * per, "main_cpu_ms": (m1 - m0) * per,
            "user_ms": (r1.ru_utime - r0.ru_utime) * per,
            "system_ms": (r1.ru_stime - r0.ru_stime) * per,
            "voluntary_switches": (r1.ru_nvcsw - r0.ru_nvcsw) / STEPS,
            "involuntary_switches": (r1.ru_nivcsw - r0.ru_nivcsw) / STEPS}


def arm(cores: str, ops: int) -> dict[str, float]:
    """Run one arm in a fresh process (pinned before MLX starts its threads)."""
    out = subprocess.run([sys.executable, __file__, "--arm", cores, "--ops", str(ops)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="an mlx-lm checkpoint whose decode step's primitives to "
                    "count (e.g. models/tiny-trained)")
    ap.add_argument("--arm", choices=("one", "all"), help=argparse.SUPPRESS)
    ap.add_argument("--ops", type=int, default=40, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        if args.arm == "one":
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(json.dumps(measure(args.ops)))
        return
    runs: list[dict] = []
    for r in range(args.rounds):
        for ops in (10, 40):
            order = ("all", "one") if r % 2 == 0 else ("one", "all")
            for cores in order:
                runs.append({"round": r, "ops": ops, "cores": cores, **arm(cores, ops)})
    table = []
    print(f"{'ops per piece':>13} {'cores':>5} {'wall ms':>8} {'main CPU':>9} {'user':>7} "
          f"{'system':>7} {'vol/invol switches':>19}   per step of {PIECES} pieces, medians")
    for ops in (10, 40):
        for cores in ("all", "one"):
            mine = [x for x in runs if x["ops"] == ops and x["cores"] == cores]
            med = {k: statistics.median(x[k] for x in mine) for k in mine[0]
                   if k not in ("round", "ops", "cores")}
            table.append({"ops": ops, "cores": cores, **med})
            print(f"{ops:>13} {cores:>5} {med['wall_ms']:8.3f} {med['main_cpu_ms']:9.3f} "
                  f"{med['user_ms']:7.3f} {med['system_ms']:7.3f} "
                  f"{med['voluntary_switches']:9.0f} / {med['involuntary_switches']:<7.0f}")
        alls, one = table[-2], table[-1]
        n = alls["primitives_per_step"]
        per = {k: (alls[k] - one[k]) / n * 1e3 for k in ("wall_ms", "main_cpu_ms")}
        per["cpu_ms"] = ((alls["user_ms"] + alls["system_ms"]) - (one["user_ms"]
                         + one["system_ms"])) / n * 1e3
        table[-2]["two_cores_more_us_per_primitive"] = per
        print(f"{'':>13} two cores cost more per primitive ({n:.0f} a step): "
              f"{per['wall_ms']:.2f} us wall, {per['cpu_ms']:.2f} us of CPU, "
              f"{per['main_cpu_ms']:.2f} of it the main thread's")
    doc = {"command": "uv run python reports/cross-machine/handover_probe.py "
                      f"--rounds {args.rounds}",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "cores": os.cpu_count(), "pieces_per_step": PIECES, "steps": STEPS,
           "medians": table, "runs": runs}
    if args.model:
        n = decode_step_primitives(args.model)
        per = table[-2]["two_cores_more_us_per_primitive"]
        doc["decode_step"] = {"model": args.model, "primitives": n,
                              **{f"two_cores_more_{k}_per_step": v * n / 1e3
                                 for k, v in per.items()}}
        print(f"{args.model}: {n} primitives a resident decode step: at the 40-link pieces' "
              f"rates, two cores cost {per['wall_ms'] * n / 1e3:.2f} ms wall, "
              f"{per['cpu_ms'] * n / 1e3:.2f} ms of CPU ({per['main_cpu_ms'] * n / 1e3:.2f} "
              "the main thread's) more a step")
    (HERE / "handover_probe.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
