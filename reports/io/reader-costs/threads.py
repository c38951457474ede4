"""Where a warm staged step's CPU goes, thread by thread: decode tok/s and CPU per decode step
(from the first decode step's start; /proc's clock ticks, 10 ms, over ~47 steps a prompt)
of the main thread, the reader threads and the rest (MLX's compute thread) for resident mlx-lm
run through the engine's loop, staged with prerouter heads, and the same with slots for every
expert (headroom 60: after the first uses nothing loads). Each arm its own process, every
expert in the page cache, sampled decoding, arms rotated over rounds, decode tok/s paired with
resident's in the same round. With --before-code DIR the staged arms also run that checkout's
engine (ARM@before). Linux (per-thread CPU from /proc/self/task).

Usage: uv run python reports/io/reader-costs/threads.py [--rounds 4] [--before-code DIR];
writes threads.json beside this script."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from engine.child_env import importing  # noqa: E402

MODEL = ROOT / "models" / "tiny-trained-stream"
ARMS = {"resident": None, "staged-prerouter": None, "staged-prerouter-slots-60": 60}
TOKENS, PROMPTS = 48, ("Once upon a time in a small village,",
                       "The history of the printing press")

WORKER = r'''
import json, os, sys, threading, time
from contract.engine_config import EngineConfig
from engine.generate import generate
from engine.loader import load_resident, load_streaming
model_dir, arm, headroom = sys.argv[1:4]
tokens, prompts = int(sys.argv[4]), json.loads(sys.argv[5])
if arm == "resident":
    model, tok = load_resident(model_dir); rt = None
else:
    extra = {} if headroom == "None" else {"staged_headroom": int(headroom)}
    eng = load_streaming(model_dir, config=EngineConfig.from_preset(
        "staged", readers=2, prerouter=os.path.join(model_dir, "prerouter"), **extra))
    model, tok, rt = eng.model, eng.tokenizer, eng.runtime
def run(p, n, on_step_start=None):
    return generate(model, tok, p, n, temp=1.0, seed=0, stop_at_eos=False, runtime=rt,
                    on_step_start=on_step_start)
run(prompts[0], 16)
def cpu_ms():
    out = {}
    readers = {t.native_id for t in threading.enumerate() if t.name.startswith("reader")}
    for tid in os.listdir("/proc/self/task"):
        f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        who = "main" if int(tid) == os.getpid() else "readers" if int(tid) in readers else "rest"
        out[who] = out.get(who, 0.0) + (int(f[11]) + int(f[12])) * 1000 / os.sysconf("SC_CLK_TCK")
    return out
seconds, steps, spent = 0.0, 0, {}
for p in prompts:
    start = []
    r = run(p, tokens, lambda step, phase, n: start or phase != "decode" or start.append(cpu_ms()))
    end = cpu_ms()  # decode only: from the first decode step's start to the last token
    seconds += r.decode_s
    steps += len(r.tokens) - 1
    for k, v in end.items():
        spent[k] = spent.get(k, 0.0) + v - start[0].get(k, 0.0)
print(json.dumps({"decode_tok_s": steps / seconds, "cpu_ms_per_step":
                  {k: spent.get(k, 0.0) / steps for k in ("main", "readers", "rest")}}))
'''


def arm_run(arm: str, checkout: Path) -> dict:
    headroom = ARMS[arm.removesuffix("@before")]
    p = subprocess.run([sys.executable, "-c", WORKER, str(MODEL), arm.removesuffix("@before"),
                        str(headroom), str(TOKENS), json.dumps(PROMPTS)], cwd=checkout,
                       env=importing(checkout), capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"threads.py: arm {arm} failed ({last})")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--before-code", type=Path, help="another checkout of ssdmoe")
    args = ap.parse_args()
    if not (MODEL / "prerouter" / "prerouter.json").is_file():
        raise SystemExit(f"threads.py: {MODEL}: no model with prerouter heads (run the demo, "
                         "then `ssdmoe train heads`)")
    if not Path("/proc/self/task").is_dir():
        raise SystemExit("threads.py: needs /proc/self/task (Linux)")
    if args.before_code and not (args.before_code / "engine" / "bench" / "arm.py").is_file():
        raise SystemExit(f"threads.py: --before-code {args.before_code}: not a checkout")
    arms = list(ARMS) + ([f"{a}@before" for a in ARMS if a != "resident"]
                         if args.before_code else [])
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            where = args.before_code if arm.endswith("@before") else ROOT
            runs[arm].append(arm_run(arm, where.resolve()))
    print("| arm | decode tok/s | paired vs resident | CPU ms/step: main | readers | rest |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for arm in arms:
        rs, base = runs[arm], runs["resident"]
        summary[arm] = {
            "decode_tok_s": statistics.median(x["decode_tok_s"] for x in rs),
            "paired_vs_resident": statistics.median(
                x["decode_tok_s"] / b["decode_tok_s"] for x, b in zip(rs, base, strict=True)),
            **{f"{k}_cpu_ms_per_step": statistics.median(x["cpu_ms_per_step"][k] for x in rs)
               for k in ("main", "readers", "rest")}}
        s = summary[arm]
        print(f"| {arm} | {s['decode_tok_s']:.1f} | {s['paired_vs_resident']:.3f}x | "
              f"{s['main_cpu_ms_per_step']:.2f} | {s['readers_cpu_ms_per_step']:.2f} | "
              f"{s['rest_cpu_ms_per_step']:.2f} |")
    cmd = "uv run python reports/io/reader-costs/threads.py --rounds " + str(args.rounds) + (
        f" --before-code {args.before_code}" if args.before_code else "")
    (HERE / "threads.json").write_text(json.dumps({
        "command": cmd, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": str(MODEL.relative_to(ROOT)), "tokens_per_prompt": TOKENS,
        "prompts": list(PROMPTS), "summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
