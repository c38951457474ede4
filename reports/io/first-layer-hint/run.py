"""Does reading the first MoE layer's experts from the token pay, and does the simulator say
so before it is measured?

The token lead's heads predict every MoE layer but the first, so at a small page cache the
first layer's experts are read after its own router, on the critical path
(reports/io/token-lead). With `--first-layer-hint` the engine starts reading the experts a
token table gives (engine.first_layer_hint, fitted by `ssdmoe train heads`) when the step's
token is on the host, before that router. This captures the token lead with and without the
hint (sampled decoding, 4 prompts x 96 tokens), unthrottled, at a page-cache budget of 1/4 of
the expert bytes and with every expert cached, the four arms' order rotated over rounds; and
replays every trace with `sim compare` on one profile (no refit). Per regime: each arm's
decode tok/s and blocked time (the first MoE layer's, the second's, the rest), measured and
simulated, and the hint's paired gain (hint / no hint, per round, then the median), measured
and simulated.

Usage: uv run python reports/io/first-layer-hint/run.py [--rounds 3] [--profiles DIR]
[--model DIR --model-profile TOML --tag NAME] (--profiles: as reports/io/token-lead/run.py).
Writes first-layer-hint[-NAME].json and the table in README.md beside this script (the one
marked with NAME); traces in runs/first-layer-hint/[NAME/]."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from reports.load_script import load_script  # noqa: E402
from traces.reader import read_trace  # noqa: E402

ARMS = {"no hint": (), "hint": ("--first-layer-hint",)}
RUNS = ROOT / "runs" / "first-layer-hint"


# token-lead's capture, figures and replay: the same captures, one flag apart
lead = load_script("io/token-lead/run.py")


def read_times(trace_dir: Path) -> dict:
    """Medians over the decode steps' cold prefetches (the token lead's reads, and the hint's):
    `queue_ms` from issue to a reader's start, `service_ms` from start to finish."""
    import polars as pl

    t = read_trace(trace_dir)
    steps = t.steps.filter(pl.col("phase") == "decode")["step"].implode()
    cold = t.loads.filter(pl.col("step").is_in(steps) & (pl.col("source") == "prefetch")
                          & pl.col("cold"))
    if not cold.height:
        return {"queue_ms": None, "service_ms": None}
    return {"queue_ms": float((cold["started_ns"] - cold["issued_ns"]).median()) / 1e6,
            "service_ms": float((cold["finished_ns"] - cold["started_ns"]).median()) / 1e6}


def paired_gain(arm: list[dict], base: list[dict]) -> float:
    """Median over rounds of arm / base decode tok/s (rounds paired in order)."""
    return statistics.median(a["decode_tok_s"] / b["decode_tok_s"]
                             for a, b in zip(arm, base, strict=True))


def _blocked(f: dict) -> tuple[float, float, float]:
    """(first MoE layer, second, the rest) of the blocked ms per step."""
    by = f["blocked_ms_by_layer"]
    layers = sorted(by)
    first = by[layers[0]] if layers else 0.0
    second = by[layers[1]] if len(layers) > 1 else 0.0
    return first, second, f["blocked_ms_per_step"] - first - second


def reads_table(results: dict) -> str:
    lines = ["| regime | arm | cold prefetch: issue to start, ms measured | simulated | start "
             "to finish, ms measured | simulated |", "|---|---|---|---|---|---|"]
    for regime, rec in results["regimes"].items():
        for arm in ARMS:
            m, s = rec["median"][arm]["measured"], rec["median"][arm]["simulated"]
            if m.get("queue_ms") is None:
                continue
            lines.append(f"| {regime} | {arm} | {lead._ms(m['queue_ms'])} | "
                         f"{lead._ms(s['queue_ms'])} | {lead._ms(m['service_ms'])} | "
                         f"{lead._ms(s['service_ms'])} |")
    return "\n".join(lines)


def table(results: dict) -> str:
    lines = ["| regime | arm | decode tok/s measured | simulated | blocked ms/step measured "
             "(first layer / second / rest) | simulated | hint's gain measured | simulated |",
             "|---|---|---|---|---|---|---|---|"]
    for regime, rec in results["regimes"].items():
        for arm in ARMS:
            m, s = rec["median"][arm]["measured"], rec["median"][arm]["simulated"]
            gain = rec["gain"] if arm == "hint" else None
            cells = ["-", "-"] if gain is None else [f"{gain['measured']:.3f}",
                                                     f"{gain['simulated']:.3f}"]
            lines.append(
                f"| {regime} | {arm} | {m['decode_tok_s']:.1f} | {s['decode_tok_s']:.1f} | "
                + " / ".join(f"{v:.2f}" for v in _blocked(m)) + " | "
                + " / ".join(f"{v:.2f}" for v in _blocked(s)) + f" | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    args = lead.replay_arguments(__doc__, "first-layer-hint")
    hint_file = args.model / "prerouter" / "first_layer_hint.npy"
    if not hint_file.is_file():
        raise SystemExit(f"run.py: {hint_file}: no first-layer hint table (ssdmoe train "
                         "hint)")
    combos = [(r, a) for r in lead.REGIMES for a in ARMS]
    rows: dict[str, dict[str, dict[str, list]]] = {
        r: {a: {"measured": [], "simulated": []} for a in ARMS} for r in lead.REGIMES}
    with tempfile.TemporaryDirectory() as tmp:
        scenario = lead.scenario_file(args.profiles.resolve() if args.profiles else None,
                                      Path(tmp), args.model_profile and
                                      args.model_profile.resolve())
        for rnd in range(args.rounds):
            shift = rnd % len(combos)
            for regime, arm in combos[shift:] + combos[:shift]:
                trace_dir = RUNS / args.tag / f"{regime}.{arm.replace(' ', '-')}.r{rnd}"
                lead.capture(args.model, regime, trace_dir, ARMS[arm])
                measured = {**lead.lead_figures(read_trace(trace_dir)), **read_times(trace_dir)}
                simulated = {**lead.simulated(trace_dir, scenario, Path(tmp) / "sim"),
                             **read_times(Path(tmp) / "sim")}
                rows[regime][arm]["measured"].append(measured)
                rows[regime][arm]["simulated"].append(simulated)
                print(f"{regime} {arm} round {rnd}: measured {measured['decode_tok_s']:.1f} "
                      f"tok/s, simulated {simulated['decode_tok_s']:.1f}", flush=True)
    first = RUNS / args.tag / f"{combos[0][0]}.{combos[0][1].replace(' ', '-')}.r0"
    results = {
        **lead.replay_header("first-layer-hint", args, first),
        "hint": json.loads((args.model / "prerouter" / "prerouter.json").read_text())
        .get("report", {}).get("first_layer_hint"),
        "regimes": {r: {"rounds": rows[r],
                        "median": {a: {k: lead.median_figures(v) for k, v in rows[r][a].items()}
                                   for a in ARMS},
                        "gain": {k: paired_gain(rows[r]["hint"][k], rows[r]["no hint"][k])
                                 for k in ("measured", "simulated")}}
                    for r in lead.REGIMES}}
    name = "first-layer-hint" + (f"-{args.tag}" if args.tag else "")
    lead.publish(results, table(results) + "\n\n" + reads_table(results),
                 HERE / f"{name}.json", HERE / "README.md", args.tag)

if __name__ == "__main__":
    main()
