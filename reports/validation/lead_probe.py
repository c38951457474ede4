"""Where the layer lead's evaluation time goes, fill point by fill point, beside the staged path
filled on demand, measured and simulated.

The held-out layer lead is the simulator's systematic miss (README: 4-28% fast over ten fresh
runs), and its measured eval per step is 2-3 ms over the simulated one. This probe captures
the staged path with lead "none" and lead "layer" the way `ssdmoe validate` does (the
validation prompts, 96 tokens, temp 1.0, seed 0) at page-cache fractions 1.0 (every read a
copy) and 0.25 (realistic misses), arms rotated over rounds, in a fresh process each. The
engine times each part of a fill point's `progress()` (engine.fill_points `phase_ns`):
  start_next  a same-token lead's next ids to the host and its reads queued
  fill        the head point's fill (its reads waited for, on demand: its ids first)
  gather      handing its gather over (mx.async_eval)
  kick        handing over the walk to the next router (async_eval blocks while work is
              queued: mostly waiting on compute)
Each capture is then replayed with `sim compare` on the committed scenario. Per arm: decode
tok/s, build, eval and blocked ms per step, measured / simulated, and the phases in ms per
fill point (medians over rounds).

    uv run python reports/validation/lead_probe.py [--rounds 2] [--fractions 1.0,0.25]

CPU-exclusive (a capture is a benchmark). Linux (page-cache budget). Writes lead_probe.json next
to this file; traces go to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HERE = Path(__file__).resolve().parent
MODEL = ROOT / "models" / "tiny-trained-stream"
PROMPTS = HERE / "prompts.jsonl"
LEADS = ("none", "layer")
MAX_TOKENS, TEMP, SEED = 96, 1.0, 0  # validate's capture settings (validation.matrix_run.capture)
FIGURES = ("decode_tok_s", "build_ms", "eval_ms", "blocked_ms")


def child(lead: str, fraction: float, out: Path, result: Path) -> None:
    """One capture in this process; writes the fill-point phases (ms per point) to `result`.
    A bad model or prompts file is one line on stderr and exit status 1."""
    from contract.errors import BadInput
    from engine.capture import capture, load_engine, read_prompts, start_recorder
    from engine.fill_points import PHASES

    try:
        texts = read_prompts(PROMPTS)
        engine = load_engine(MODEL, preset="staged", lead=lead, page_cache_fraction=fraction)
    except BadInput as err:
        sys.exit(f"lead_probe: {err}")
    try:
        rec = start_recorder(out, engine, extra={"capture": {
            "prompts_file": str(PROMPTS), "prompts": len(texts), "max_tokens": MAX_TOKENS,
            "temp": TEMP, "seed": SEED}})
        with rec:
            capture(engine, texts, MAX_TOKENS, recorder=rec, temp=TEMP, seed=SEED)
        fills = engine.runtime.fills
        calls = max(fills.phase_calls, 1)
        phases = {p: fills.phase_ns[p] / 1e6 / calls for p in PHASES}
    finally:
        engine.close()
    result.write_text(json.dumps({"phases_ms": phases, "points": fills.phase_calls}))


def measured_and_simulated(trace_dir: Path) -> dict[str, dict[str, float]]:
    from sim.compare import compare
    from traces.reader import read_trace

    comp = compare(read_trace(trace_dir))
    m, s, e = comp.measured, comp.simulated, comp.extra

    def figures(tok_s, build, eval_, blocked) -> dict[str, float]:
        return dict(zip(FIGURES, (tok_s, build, eval_, blocked), strict=True))

    return {"measured": figures(m["decode_tok_s"], e["measured_build_ms_per_step"],
                                e["measured_eval_ms_per_step"], m["blocked_ms_per_step"]),
            "simulated": figures(s["decode_tok_s"], e["build_ms_per_step"],
                                 e["eval_ms_per_step"], s["blocked_ms_per_step"])}


def run(rounds: int, fractions: list[float]) -> dict:
    arms = [(lead, f) for f in fractions for lead in LEADS]
    per: dict[str, list[dict]] = {f"{lead} @ {f:g}": [] for lead, f in arms}
    with tempfile.TemporaryDirectory(prefix="lead_probe-") as tmp:
        for r in range(rounds):
            for lead, f in arms[r % len(arms):] + arms[:r % len(arms)]:
                name = f"{lead} @ {f:g}"
                out, result = Path(tmp) / f"{lead}-{f:g}-{r}", Path(tmp) / f"{lead}-{f:g}-{r}.json"
                done = subprocess.run([sys.executable, __file__, "--child", lead, str(f),
                                       str(out), str(result)])
                if done.returncode:
                    sys.exit(f"lead_probe: the {name} capture failed (exit status "
                             f"{done.returncode}; its message is above)")
                got = json.loads(result.read_text())
                got.update(measured_and_simulated(out))
                per[name].append(got)
                print(f"round {r}: {name}: {got['measured']['decode_tok_s']:.1f} tok/s measured",
                      flush=True)
    rows = []
    for name, runs in per.items():
        def med(side: str, keys, runs=runs) -> dict[str, float]:
            return {k: statistics.median(x[side][k] for x in runs) for k in keys}
        rows.append({"arm": name, "measured": med("measured", FIGURES),
                     "simulated": med("simulated", FIGURES),
                     "phases_ms": med("phases_ms", runs[0]["phases_ms"]),
                     "rounds_decode_tok_s": [x["measured"]["decode_tok_s"] for x in runs]})
    return {"command": " ".join(["uv run python reports/validation/lead_probe.py",
                                 *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(MODEL),
            "rounds": rounds, "arms": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fractions", default="1.0,0.25")
    ap.add_argument("--child", nargs=4, metavar=("LEAD", "FRACTION", "OUT", "RESULT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        lead, fraction, out, result = args.child
        child(lead, float(fraction), Path(out), Path(result))
        return
    try:
        fractions = [float(x) for x in args.fractions.split(",")]
    except ValueError:
        sys.exit(f"lead_probe: --fractions: numbers separated by commas, got {args.fractions!r}")
    if args.rounds < 1 or not all(0 < f <= 1 for f in fractions):
        sys.exit(f"lead_probe: --rounds must be >= 1 and fractions in (0, 1], got "
                 f"{args.rounds} and {args.fractions}")
    if not (MODEL / "manifest.json").is_file():
        sys.exit(f"lead_probe: {MODEL}: no converted model (bash scripts/demo.sh builds it)")
    doc = run(args.rounds, fractions)
    print(f"{'arm':12s} {'tok/s meas/sim':>15s} {'build':>11s} {'eval':>11s} {'blocked':>11s}"
          "   phases ms/point: start_next fill gather kick")
    for a in doc["arms"]:
        m, s = a["measured"], a["simulated"]
        cols = " ".join(f"{m[k]:5.2f}/{s[k]:5.2f}" for k in FIGURES[1:])
        ph = " ".join(f"{v:.3f}" for v in a["phases_ms"].values())
        print(f"{a['arm']:12s} {m['decode_tok_s']:7.1f}/{s['decode_tok_s']:6.1f} {cols}   {ph}")
    (HERE / "lead_probe.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {HERE / 'lead_probe.json'}")


if __name__ == "__main__":
    main()
