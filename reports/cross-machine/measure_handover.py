"""What handing work to MLX's compute thread costs per operation, with the two threads on two
cores and on one: calibration.handover_probe (what `ssdmoe calibrate` measures for the sim's
cross_core_op_us), at 10 links a piece (below MLX's bound of 10 tasks in flight) and at 40
(past it), each link five primitives. With `--model`, the primitives of one resident decode
step of that mlx-lm checkpoint are counted the same way: what the per-primitive difference
comes to per step.

Usage: uv run python reports/cross-machine/measure_handover.py [--rounds 3] [--model
models/tiny-trained]; writes handover_probe.json beside this script (named apart from
calibration.handover_probe, the module it runs)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from calibration.handover_probe import PIECES, measure, primitives  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="an mlx-lm checkpoint whose decode step's primitives to "
                    "count (e.g. models/tiny-trained)")
    args = ap.parse_args()
    doc: dict = {"command": "uv run python reports/cross-machine/measure_handover.py --rounds "
                 f"{args.rounds}" + (f" --model {args.model}" if args.model else ""),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "pieces_per_step": PIECES, "by_links": {}}
    print(f"{'links':>5} {'cores':>5} {'wall ms':>8} {'main CPU':>9} {'CPU':>7} {'system':>7} "
          f"{'vol/invol switches':>19}   per step of {PIECES} pieces, medians")
    for links in (10, 40):
        h = measure(args.rounds, links)
        if h is None:
            raise SystemExit("measure_handover.py: needs two cores and sched_setaffinity (Linux)")
        doc["by_links"][links] = asdict(h)
        for arm in ("all", "one"):
            a = h.arms[arm]
            print(f"{links:>5} {arm:>5} {a['wall_ms']:8.3f} {a['main_cpu_ms']:9.3f} "
                  f"{a['cpu_ms']:7.3f} {a['system_ms']:7.3f} "
                  f"{a['voluntary_switches']:9.0f} / {a['involuntary_switches']:<7.0f}")
        print(f"{'':>11} every core costs more per primitive ({h.primitives} a step): "
              f"{h.wall_us:.2f} us wall, {h.cpu_us:.2f} us of CPU, {h.main_cpu_us:.2f} of it "
              "the main thread's")
    if args.model:
        n = decode_step_primitives(args.model)
        h40 = doc["by_links"][40]
        doc["decode_step"] = {"model": args.model, "primitives": n,
                              **{f"more_{k}_ms_per_step": h40[k] * n / 1e3
                                 for k in ("wall_us", "cpu_us", "main_cpu_us")}}
        print(f"{args.model}: {n} primitives a resident decode step: at 40 links' rates, "
              f"every core costs {h40['wall_us'] * n / 1e3:.2f} ms wall, "
              f"{h40['cpu_us'] * n / 1e3:.2f} ms of CPU ({h40['main_cpu_us'] * n / 1e3:.2f} the "
              "main thread's) more a step")
    (HERE / "handover_probe.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
