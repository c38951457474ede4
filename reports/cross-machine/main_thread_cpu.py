"""Where the main thread's CPU goes in a decode step, by decode path, on every core and on one.

Each arm runs in its own process (pinned to one core before MLX starts its compute thread, as
calibration.handover_probe does), decodes the default prompts with sampled tokens (temperature
1), and times every decode step: its wall time, the process's CPU, the main thread's CPU, and
the main thread's CPU inside each part of the engine's loop, exclusive of the parts nested in it
(and, from the kernel's per-thread accounting, the reader threads' CPU and the rest: MLX's compute
thread):

  dispatch  mx.async_eval: MLX prepares and dispatches each operation on the calling thread
  fills     FillPoints._at_step: the fill points' host work (the router's or the predicted ids
            on the host, slot placement, read plans and starts, waiting for and collecting
            loads), less its dispatch
  begin     FillPoints.begin less the above: the predicted ids' one sync a step
  build     StepLoop.build less the above: graph building (the model's Python)
  other     the rest of the step: sampling, the token on the host, the loop, the row

Arms: mlx-lm's own resident model (generate_step: total figures only, its dispatch inside
async_eval), and the streaming engine's staged path without a lead (its slots filled on
demand), with the prerouter's token lead, with the layer lead, and its exact path on demand
(the synchronous loop: each router's ids to the host while the graph is built). The page
cache holds every expert (warm) unless --page-cache gives the engine's budget as a fraction of
the expert bytes. Rounds rotate the arms; figures are medians over rounds of per-step means
over the prompts.

Usage: uv run python reports/cross-machine/main_thread_cpu.py [--model models/tiny-trained-stream]
[--tokens 64] [--rounds 2] [--page-cache F] [--arms a,b]; writes main-thread-cpu.json (or
main-thread-cpu[-MODEL][-ARMS][-pcF].json, MODEL named where it is not the default) beside
this script and prints the table. Linux (sched_setaffinity)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_MODEL = "models/tiny-trained-stream"
sys.path.insert(0, str(ROOT))

from engine.child_env import importing  # noqa: E402
from engine.manifest import sha256_file  # noqa: E402

ARMS = ("resident", "staged", "staged-token", "staged-layer", "on-demand")
PARTS = ("dispatch", "fills", "begin", "build", "other")


def thread_cpu_ns() -> dict[int, int]:
    """{thread id: CPU ns} of this process's threads (the kernel's schedstat)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended
    return out


def split_threads(before: dict[int, int], after: dict[int, int], steps: int) -> dict[str, float]:
    """ms a step of the engine's reader threads (Python threads named reader-N) and of the
    rest but the main thread (MLX's compute thread)."""
    import threading

    main = threading.main_thread().native_id
    readers = {t.native_id for t in threading.enumerate() if t.name.startswith("reader")}
    spent = {tid: after[tid] - before.get(tid, 0) for tid in after}
    return {"readers_cpu_ms": sum(v for t, v in spent.items() if t in readers) / 1e6 / steps,
            "compute_cpu_ms": sum(v for t, v in spent.items()
                                  if t != main and t not in readers) / 1e6 / steps}


class Exclusive:
    """Thread CPU per named part, each exclusive of the parts running inside it."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.stack: list[list[int]] = []  # [start, CPU of the parts inside it]

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.stack.append([time.thread_time_ns(), 0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, inner = self.stack.pop()
                spent = time.thread_time_ns() - start
                self.total[name] += spent - inner
                if self.stack:
                    self.stack[-1][1] += spent
        return timed


def _engine_run(arm: str, model: Path, prompts: list[str], tokens: int,
                page_cache: float | None) -> list[dict]:
    import mlx.core as mx

    import engine.fill_points as fill_points
    import engine.generate as generate_module
    from contract.engine_config import EngineConfig
    from engine.capture import expert_bytes
    from engine.loader import load_streaming, open_manifest

    parts = Exclusive()
    mx.async_eval = parts.wrap("dispatch", mx.async_eval)
    fill_points.FillPoints._at_step = parts.wrap("fills", fill_points.FillPoints._at_step)
    fill_points.FillPoints.begin = parts.wrap("begin", fill_points.FillPoints.begin)
    loop = generate_module.StepLoop
    loop.build = parts.wrap("build", loop.build)
    budget = (int(page_cache * expert_bytes(open_manifest(model, verify=False)))
              if page_cache else None)
    lead = {"staged-token": {"prerouter": model / "prerouter"},
            "staged-layer": {"lead_kind": "layer"}}.get(arm, {})
    engine = load_streaming(model, config=EngineConfig.from_preset(
        "on-demand" if arm == "on-demand" else "staged", page_cache_budget=budget, **lead))
    rows = []
    for i, prompt in enumerate(["Hello there", *prompts]):  # the first one warms up
        start: list[int] = []
        threads: dict[int, int] = {}

        def decoding(_step: int, phase: str, _tokens: int, start=start,
                     threads=threads) -> None:
            if phase == "decode" and not start:  # decode from here (prefill left out)
                parts.total.clear()
                start.extend((time.thread_time_ns(), time.process_time_ns(),
                              time.perf_counter_ns()))
                threads.clear()
                threads.update(thread_cpu_ns())

        r = generate_module.generate(engine.model, engine.tokenizer, prompt, tokens, temp=1.0,
                                     seed=i, stop_at_eos=False, runtime=engine.runtime,
                                     on_step_start=decoding)
        if i == 0:
            continue
        steps = sum(1 for s in r.steps if s["phase"] == "decode")
        c0, p0, w0 = start
        row = {"wall_ms": (time.perf_counter_ns() - w0) / 1e6 / steps,
               "process_cpu_ms": (time.process_time_ns() - p0) / 1e6 / steps,
               "main_cpu_ms": (time.thread_time_ns() - c0) / 1e6 / steps}
        row.update({f"{p}_ms": parts.total[p] / 1e6 / steps for p in PARTS[:-1]})
        row.update(split_threads(threads, thread_cpu_ns(), steps))
        rows.append(row)
    return rows


def _resident_run(model: Path, prompts: list[str], tokens: int) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from engine.loader import load_resident

    parts = Exclusive()
    mx.async_eval = parts.wrap("dispatch", mx.async_eval)
    resident, tokenizer = load_resident(model)
    rows = []
    for i, prompt in enumerate(["Hello there", *prompts]):
        mx.random.seed(i)
        ids = mx.array(tokenizer.encode(prompt))
        for n, _ in enumerate(generate_step(ids, resident, max_tokens=tokens + 1,
                                            sampler=make_sampler(1.0))):
            if n == 0:  # the prompt's own step done: decode from here
                parts.total.clear()
                c0, p0 = time.thread_time_ns(), time.process_time_ns()
                w0 = time.perf_counter_ns()
                threads = thread_cpu_ns()
        if i == 0:
            continue
        rows.append({"wall_ms": (time.perf_counter_ns() - w0) / 1e6 / tokens,
                     "process_cpu_ms": (time.process_time_ns() - p0) / 1e6 / tokens,
                     "main_cpu_ms": (time.thread_time_ns() - c0) / 1e6 / tokens,
                     "dispatch_ms": parts.total["dispatch"] / 1e6 / tokens,
                     **split_threads(threads, thread_cpu_ns(), tokens)})
    return rows


def arm_figures(arm: str, model: str, tokens: int, page_cache: float | None) -> dict:
    """One arm in this process: the per-step figures, means over the default prompts."""
    from engine.capture import read_prompts

    prompts = read_prompts(ROOT / "traces" / "prompts" / "default.jsonl")[:4]
    rows = (_resident_run(Path(model), prompts, tokens) if arm == "resident" else
            _engine_run(arm, Path(model), prompts, tokens, page_cache))
    out = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    if arm != "resident":
        out["other_ms"] = out["main_cpu_ms"] - sum(out[f"{p}_ms"] for p in PARTS[:-1])
    return out


def _child(arm: str, one_core: bool, model: str, tokens: int, page_cache: float | None) -> dict:
    code = ("import json, os, sys\n"
            "if sys.argv[2] == 'one':\n"
            "    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "sys.path.insert(0, sys.argv[6])\n"
            "from reports.load_script import load_script\n"
            "m = load_script('cross-machine/main_thread_cpu.py')\n"
            "pc = float(sys.argv[5]) or None\n"
            "print(json.dumps(m.arm_figures(sys.argv[1], sys.argv[3], int(sys.argv[4]), pc)))\n")
    out = subprocess.run([sys.executable, "-c", code, arm, "one" if one_core else "all", model,
                          str(tokens), str(page_cache or 0), str(ROOT)],
                         capture_output=True, text=True, cwd=ROOT, env=importing(ROOT))
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"main_thread_cpu.py: the {arm} arm failed: {last}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--page-cache", type=float, default=None)
    ap.add_argument("--arms", default=",".join(ARMS), help="a comma-separated subset of ARMS")
    args = ap.parse_args()
    chosen = args.arms.split(",")
    if any(a not in ARMS for a in chosen):
        raise SystemExit(f"main_thread_cpu.py: --arms {args.arms}: arms are {', '.join(ARMS)}")
    if not (ROOT / args.model / "manifest.json").is_file():
        raise SystemExit(f"main_thread_cpu.py: {args.model}: not a converted model (no "
                         "manifest.json; ssdmoe convert makes one)")
    if "staged-token" in chosen and not (ROOT / args.model / "prerouter").is_dir():
        raise SystemExit(f"main_thread_cpu.py: {args.model}: no prerouter/ heads (ssdmoe train "
                         "heads) for the token-lead arm")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("main_thread_cpu.py: this process has one core: nothing to compare")
    arms = [(arm, one) for arm in ARMS if arm in chosen for one in (False, True)]
    runs: dict[str, list[dict]] = {}
    order = []
    for r in range(args.rounds):
        turn = arms[r % len(arms):] + arms[:r % len(arms)]  # rotated each round
        order.append([f"{a}/{'one' if o else 'all'}" for a, o in turn])
        for arm, one in turn:
            key = f"{arm}/{'one' if one else 'all'}"
            runs.setdefault(key, []).append(_child(arm, one, args.model, args.tokens,
                                                   args.page_cache))
            print(f"[round {r + 1}/{args.rounds}] {key}: "
                  f"{1e3 / runs[key][-1]['wall_ms']:.1f} tok/s", file=sys.stderr)
    table = {key: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]}
             for key, rs in runs.items()}
    manifest = json.loads((ROOT / args.model / "manifest.json").read_text())
    subset = "" if set(chosen) == set(ARMS) else "-" + "-".join(chosen)
    model = "" if Path(args.model) == Path(DEFAULT_MODEL) else \
        "-" + Path(args.model).name.removesuffix("-stream")  # the default model goes unnamed
    name = (f"main-thread-cpu{model}{subset}"
            f"{f'-pc{args.page_cache:g}' if args.page_cache else ''}.json")
    (HERE / name).write_text(json.dumps({
        "command": "uv run python reports/cross-machine/main_thread_cpu.py "
                   + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model, "manifest_sha256": sha256_file(ROOT / args.model / "manifest.json"),
        "experts": manifest.get("num_experts"), "tokens": args.tokens, "rounds": args.rounds,
        "page_cache": args.page_cache, "order": order, "table": table, "runs": runs},
        indent=1) + "\n")
    cols = ("wall_ms", "process_cpu_ms", "compute_cpu_ms", "readers_cpu_ms", "main_cpu_ms",
            *(f"{p}_ms" for p in PARTS))
    print("| arm | cores | tok/s | " + " | ".join(c[:-3].replace("_", " ") + " ms/step"
                                                   for c in cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for key, fig in table.items():
        arm, cores = key.split("/")
        print(f"| {arm} | {cores} | {1e3 / fig['wall_ms']:.1f} | "
              + " | ".join(f"{fig[c]:.2f}" if c in fig else "-" for c in cols) + " |")
    print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
