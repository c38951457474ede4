"""What handing an operation to MLX's compute thread costs more when that thread and the main
thread run on different cores than on one (sim key cross_core_op_us, with the main thread's
share cross_core_op_main_us).

A decode step reduced to its hand-overs: chains of small element-wise operations (no BLAS),
handed over in PIECES `mx.async_eval` pieces as the engine's fill points do, then one
`mx.eval`. Each arm is its own process (MLX starts its compute thread at first use, so the pin
comes first): one on every core, one pinned to a single core (sched_setaffinity: no root).
Arms alternate over rounds; the figures are per primitive, counted from the graph
(mx.export_to_dot), and medians over rounds. On a machine with one core, or without
sched_setaffinity (macOS), nothing is measured."""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine.child_env import importing

PIECES = 6  # hand-overs a step: about one per MoE layer of a small model
LINKS = 40  # links a piece, y = tanh(y * a + b): past MLX's bound of 10 tasks in flight
STEPS = 400


@dataclass(frozen=True)
class Handover:
    """Per MLX primitive: how much more wall time and main-thread CPU a step takes on every
    core than on one, over `primitives` a step and `rounds` rounds."""

    wall_us: float
    main_cpu_us: float
    cpu_us: float  # the process's CPU (user + system), every thread
    primitives: int
    rounds: int
    arms: dict[str, dict[str, float]]  # "all" / "one" -> median per-step figures


def primitives(*outputs) -> int:
    """MLX primitives in the (unevaluated) graph of `outputs`."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return len(re.findall(r'label ="\w+", shape=rectangle', Path(f.name).read_text()))


def _chain(y, links: int):
    import mlx.core as mx

    for _ in range(links):
        y = mx.tanh(y * 1.0001 + 0.001)
    return y


def step_figures(links: int = LINKS, steps: int = STEPS) -> dict[str, float]:
    """One arm, in this process: per-step figures over `steps` steps after 50 of warm-up."""
    import mlx.core as mx

    x = mx.ones((256,))
    mx.eval(x)

    def step() -> None:
        y = x
        for _ in range(PIECES):
            y = _chain(y, links)
            mx.async_eval(y)
        mx.eval(y)

    for _ in range(50):
        step()
    r0, m0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    for _ in range(steps):
        step()
    t1, m1, r1 = time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_SELF)
    per = 1e3 / steps
    return {"primitives": PIECES * primitives(_chain(x, links)),
            "wall_ms": (t1 - t0) * per, "main_cpu_ms": (m1 - m0) * per,
            "cpu_ms": (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * per,
            "system_ms": (r1.ru_stime - r0.ru_stime) * per,
            "voluntary_switches": (r1.ru_nvcsw - r0.ru_nvcsw) / steps,
            "involuntary_switches": (r1.ru_nivcsw - r0.ru_nivcsw) / steps}


def _arm(one_core: bool, links: int, steps: int) -> dict[str, float]:
    code = ("import json, os, sys\n"
            "if sys.argv[1] == 'one':\n"
            "    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "from calibration.handover_probe import step_figures\n"
            "print(json.dumps(step_figures(int(sys.argv[2]), int(sys.argv[3]))))\n")
    out = subprocess.run([sys.executable, "-c", code, "one" if one_core else "all", str(links),
                          str(steps)], check=True, capture_output=True, text=True,
                         env=importing(Path(__file__).resolve().parents[1]))
    return json.loads(out.stdout.splitlines()[-1])


def can_measure() -> bool:
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


def measure(rounds: int = 3, links: int = LINKS, steps: int = STEPS) -> Handover | None:
    """The per-primitive difference, every core against one; None where it cannot be measured
    (one core, or no sched_setaffinity)."""
    if not can_measure():
        return None
    runs: dict[str, list[dict[str, float]]] = {"all": [], "one": []}
    for r in range(rounds):
        for arm in (("all", "one") if r % 2 == 0 else ("one", "all")):
            runs[arm].append(_arm(arm == "one", links, steps))
    med = {arm: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
           for arm, rs in runs.items()}
    n = med["all"]["primitives"]

    def more(key: str) -> float:
        return (med["all"][key] - med["one"][key]) / n * 1e3

    return Handover(wall_us=more("wall_ms"), main_cpu_us=more("main_cpu_ms"),
                    cpu_us=more("cpu_ms"), primitives=int(n), rounds=rounds, arms=med)
