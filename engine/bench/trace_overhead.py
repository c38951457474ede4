"""What tracing costs: decode tok/s with the recorder on vs off, in one process, on one loaded
model (`ssdmoe capture MODEL --overhead`).

Protocol: one warm-up generation per arm (excluded: the CPU backend JIT-compiles kernels on first
use). Then `rounds` rounds; in each round every prompt is generated once per arm, the arm order
alternating from prompt to prompt and the starting arm alternating from round to round, so slow
drift of a shared machine hits both arms alike. Per round and arm: decode tok/s = decode steps /
decode wall time over the round's prompts (decode wall time includes the recorder's hooks and
its periodic flushes). Reported: per-arm medians over rounds and overhead % = (off - on) / off,
plus the recorder's own time (measured inside its hooks) per decode step as a drift-free
cross-check.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.capture import capture
from engine.engine import Engine
from engine.recorder import Recorder, engine_info, run_info

ARMS = ("off", "on")


def measure_overhead(
    engine: Engine,
    prompts: list[str],
    max_tokens: int,
    rounds: int = 5,
    *,
    workdir: Path | None = None,
    recorder_opts: dict[str, Any] | None = None,
    on_run: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    opts = dict(recorder_opts or {})
    tmp = Path(tempfile.mkdtemp(prefix="trace-overhead-", dir=workdir))
    info = engine_info(engine)
    runs: list[dict[str, Any]] = []  # one per (round, arm)
    gens: list[dict[str, Any]] = []  # one per (round, prompt, arm)
    try:
        def one(recorder: Recorder | None, prompt: str, request: int) -> tuple[int, float]:
            """Generate `prompt`, traced when `recorder` -> (decode steps, decode seconds)."""
            step0 = 0
            if recorder is not None:
                recorder.attach(engine)
                step0 = recorder.steps
            try:
                results = capture(engine, [prompt], max_tokens,
                                  recorder=recorder, step0=step0, request0=request)
            finally:
                if recorder is not None:
                    recorder.detach()
            steps = sum(1 for r in results for s in r.steps if s["phase"] == "decode")
            return steps, sum(r.decode_s for r in results)

        # Warm-up, excluded.
        warm = Recorder(tmp / "warmup", run_info(engine.manifest, info), **opts)
        one(warm, prompts[0], 0)
        one(None, prompts[0], 0)
        warm.close()

        for rnd in range(rounds):
            rec = Recorder(tmp / f"round{rnd}", run_info(engine.manifest, info), **opts)
            for p, prompt in enumerate(prompts):
                order = ARMS if (rnd + p) % 2 == 0 else ARMS[::-1]
                for arm in order:
                    steps, seconds = one(rec if arm == "on" else None, prompt, p)
                    row = {"round": rnd, "prompt": p, "arm": arm, "first": order[0],
                           "decode_steps": steps, "decode_s": seconds}
                    gens.append(row)
            rec_ms = rec.overhead_ns / 1e6
            flush_ms = rec.writer.flush_s * 1e3
            rec_steps = rec.steps
            rec.close()
            for arm in ARMS:
                mine = [g for g in gens if g["round"] == rnd and g["arm"] == arm]
                steps = sum(g["decode_steps"] for g in mine)
                seconds = sum(g["decode_s"] for g in mine)
                row = {"round": rnd, "arm": arm, "first_arm": ARMS[rnd % 2],
                       "decode_steps": steps, "decode_s": seconds,
                       "decode_tok_s": steps / seconds if seconds > 0 else 0.0}
                if arm == "on":
                    row.update(recorder_ms=rec_ms, flush_ms=flush_ms,
                               recorder_ms_per_step=rec_ms / max(rec_steps, 1))
                runs.append(row)
                if on_run is not None:
                    on_run(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(runs, gens, prompts=len(prompts), max_tokens=max_tokens, rounds=rounds)


def summarize(runs: list[dict[str, Any]], gens: list[dict[str, Any]] | None = None,
              **params: Any) -> dict[str, Any]:
    """Per-arm medians of the rounds' decode tok/s and overhead % = (off - on) / off; with the
    per-prompt generations `gens`, also the paired estimate: the median over (round, prompt) of
    1 - (on tok/s / off tok/s), the two generations of a pair having run back to back."""
    med = {arm: statistics.median(r["decode_tok_s"] for r in runs if r["arm"] == arm)
           for arm in ARMS}
    on = [r for r in runs if r["arm"] == "on"]
    ms_step = statistics.median(r["recorder_ms_per_step"] for r in on)
    step_ms_on = 1e3 / med["on"] if med["on"] else None
    paired = None
    spread = None
    if gens:
        rate = {(g["round"], g["prompt"], g["arm"]): g["decode_steps"] / g["decode_s"]
                for g in gens if g["decode_s"] > 0}
        ratios = [rate[(r, p, "on")] / rate[(r, p, "off")]
                  for (r, p, arm) in rate if arm == "off" and (r, p, "on") in rate]
        paired = 100.0 * (1.0 - statistics.median(ratios)) if ratios else None
        if len(ratios) >= 2:  # the pair-to-pair spread: how much noise the estimate sits in
            q = statistics.quantiles([100.0 * (1.0 - r) for r in ratios], n=10)
            spread = (q[0], q[-1])
    return {
        **params,
        "protocol": "same process, one loaded model; warm-up excluded; per round each prompt "
                    "once per arm back to back, arm order alternating per prompt and per "
                    "round; medians over rounds",
        "median_decode_tok_s": med,
        "overhead_pct": 100.0 * (med["off"] - med["on"]) / med["off"] if med["off"] else None,
        "paired_overhead_pct": paired,
        "paired_overhead_p10_p90": spread,
        "recorder_ms_per_step": ms_step,
        "recorder_pct_of_step": 100.0 * ms_step / step_ms_on if step_ms_on else None,
        "runs": runs,
        "generations": gens or [],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
