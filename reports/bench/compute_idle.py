"""Where a decode step's time goes, per thread: is MLX's compute thread busier, or idle more?

For each arm, in one process, arms rotated each round (the benchmark's two prompts, greedy),
per decode step: wall time, the main thread's and the compute thread's time on a CPU, and the
compute thread's idle time (wall - on CPU - runnable but waiting for a CPU), from Linux's
per-thread scheduler statistics (/proc/self/task/*/schedstat: ns on CPU, ns runnable but
waiting, times scheduled). The compute thread is the busiest non-main thread.
  engine-resident  the resident model through engine.generate (no fill points)
  staged           preset staged (fill points, misses read on demand)
  staged-all-hit   preset staged with every expert in a slot (fill points, no reads)
  staged-prerouter preset staged with MODEL/prerouter's heads (when present): layers 1-5
                   routed by prediction, staged a token ahead (one on-demand fill point)

Run: uv run python reports/bench/compute_idle.py [MODEL] [--rounds N]  (Linux only; default
models/tiny-trained-stream, 8 rounds: about two minutes). Prints a table and writes
reports/bench/compute-idle.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).with_name("compute-idle.json")
FIELDS = ("wall_us", "main_cpu_us", "compute_cpu_us", "compute_idle_us", "compute_waits")


def sched() -> dict[str, tuple[int, int, int]]:
    """tid -> (ns on CPU, ns runnable but not running, times scheduled in)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        run, wait, slices = open(f"/proc/self/task/{tid}/schedstat").read().split()
        out[tid] = (int(run), int(wait), int(slices))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "tiny-trained-stream"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if not Path("/proc/self/task").is_dir():
        sys.exit("compute_idle.py: needs Linux's /proc/self/task/*/schedstat")
    if not Path(args.model, "manifest.json").is_file():
        sys.exit(f"{args.model}: no converted model (uv run ssdmoe convert models/tiny-trained "
                 "models/tiny-trained-stream)")

    from contract.engine_config import EngineConfig
    from engine.bench.benchmark import PROMPTS, load_prompts
    from engine.generate import generate
    from engine.loader import load_resident, load_streaming

    prompts = load_prompts(PROMPTS, 2)
    resident = (*load_resident(args.model), None)
    staged_engine = load_streaming(args.model, config=EngineConfig.from_preset("staged"))
    m = staged_engine.manifest
    all_hit_engine = load_streaming(args.model, config=EngineConfig.from_preset(
        "staged", staged_headroom=m.num_experts - m.top_k))
    staged = (staged_engine.model, staged_engine.tokenizer, staged_engine.runtime)
    all_hit = (all_hit_engine.model, all_hit_engine.tokenizer, all_hit_engine.runtime)
    main_tid = str(os.getpid())

    def run(model, tok, runtime) -> dict[str, float]:
        first: list = []

        def on_start(step: int, phase: str, tokens: int) -> None:
            if phase == "decode" and not first:
                first.append((sched(), time.perf_counter_ns()))

        total: dict[str, list[int]] = {}
        wall = steps = 0
        for p in prompts:
            first.clear()
            r = generate(model, tok, p, args.tokens, stop_at_eos=False, runtime=runtime,
                         on_step_start=on_start)
            after, t1 = sched(), time.perf_counter_ns()
            before, t0 = first[0]
            for tid, now in after.items():
                was = before.get(tid, (0, 0, 0))
                acc = total.setdefault(tid, [0, 0, 0])
                for i in range(3):
                    acc[i] += now[i] - was[i]
            wall += t1 - t0
            steps += sum(1 for s in r.steps if s["phase"] == "decode")
        main = total.pop(main_tid)
        compute = max(total.values(), key=lambda v: v[0])
        return {"wall_us": wall / steps / 1e3, "main_cpu_us": main[0] / steps / 1e3,
                "compute_cpu_us": compute[0] / steps / 1e3,
                "compute_idle_us": (wall - compute[0] - compute[1]) / steps / 1e3,
                "compute_waits": compute[2] / steps}

    arms = {"engine-resident": resident, "staged": staged, "staged-all-hit": all_hit}
    heads = Path(args.model, "prerouter")
    if (heads / "prerouter.json").is_file():
        pre = load_streaming(args.model, config=EngineConfig.from_preset(
            "staged", prerouter=str(heads)))
        arms["staged-prerouter"] = (pre.model, pre.tokenizer, pre.runtime)
    for arm in arms.values():  # warm-up: JIT kernels, fill slots
        run(*arm)
    rounds: dict[str, list[dict]] = {a: [] for a in arms}
    names = list(arms)
    for r in range(args.rounds):
        for a in names[r % len(names):] + names[:r % len(names)]:
            rounds[a].append(run(*arms[a]))
    med = {a: {k: statistics.median(x[k] for x in v) for k in FIELDS} for a, v in rounds.items()}
    print(f"{args.model}: {args.tokens} tokens x {len(prompts)} prompts, {args.rounds} rounds, "
          "one process; per decode step, medians over rounds")
    print("| arm | wall us | main thread on CPU us | compute thread on CPU us | "
          "compute thread idle us | compute thread sleeps |")
    print("|---|---|---|---|---|---|")
    for a, v in med.items():
        print(f"| {a} | {v['wall_us']:.0f} | {v['main_cpu_us']:.0f} | {v['compute_cpu_us']:.0f}"
              f" | {v['compute_idle_us']:.0f} | {v['compute_waits']:.1f} |")
    OUT.write_text(json.dumps({"command": "uv run python reports/bench/compute_idle.py",
                               "model": args.model, "tokens": args.tokens,
                               "loadavg": os.getloadavg(), "medians": med, "rounds": rounds},
                              indent=1) + "\n")
    print(f"wrote {OUT}")
    for loaded in (staged_engine, all_hit_engine):
        loaded.close()


if __name__ == "__main__":
    main()
