"""Native reader threads against Python ones, in one run: does taking the interpreter lock off
the read path pay, and does the simulator say so from the trace alone?

Each round captures every (path, regime) twice, with the engine's native reads
(engine.native_reads, `--native-reads`) and with `--no-native-reads` (Python reader threads), the
captures' order rotated over rounds, sampled decoding (4 prompts x 96 tokens, temperature 1,
seed 0), unthrottled. Paths: staged with the token lead (the prerouter's heads), staged with
no lead, on demand; regimes: a page-cache budget of 1/4 of the expert bytes ("quarter"), and
every expert cached ("all", the token lead only). Every trace is replayed by `sim compare` on
one profile (no refit). Per row: decode tok/s and blocked ms/step, measured and simulated, the
cold prefetches' issue-to-start and start-to-finish times, CPU ms/step, and the paired gain
(native / Python, per round, then the median), measured and simulated.

Usage: uv run python reports/io/native-reads/run.py [--rounds 3] [--profiles DIR]
[--model DIR --model-profile TOML --tag NAME] (--profiles: as reports/io/token-lead/run.py).
Writes native-reads[-NAME].json and the table in README.md beside this script (the one marked
with NAME); traces in runs/native-reads/[NAME/]."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from reports.load_script import load_script  # noqa: E402
from traces.reader import read_trace  # noqa: E402
from traces.summary import summarize  # noqa: E402

ARMS = {"python": ("--no-native-reads",), "native": ("--native-reads",)}
RUNS = ROOT / "runs" / "native-reads"


# the sibling reports' capture settings, figures and replay
lead = load_script("io/token-lead/run.py")
hint = load_script("io/first-layer-hint/run.py")


def path_args(path: str, model: Path) -> list[str]:
    return {"token lead": ["--preset", "staged", "--prerouter", str(model / "prerouter")],
            "staged": ["--preset", "staged"],
            "on-demand": ["--preset", "on-demand"]}[path]


CASES = [("token lead", "quarter"), ("token lead", "all"), ("staged", "quarter"),
         ("on-demand", "quarter")]


def capture(model: Path, path: str, regime: str, out: Path, extra: tuple[str, ...]) -> None:
    cmd = ["uv", "run", "ssdmoe", "capture", str(model), "--out", str(out), "--force",
           "--no-progress", "--prompts", str(lead.PROMPTS), "--max-tokens", "96", "--temp",
           "1.0", "--seed", "0", *path_args(path, model), *lead.REGIMES[regime], *extra]
    lead.run(cmd, cwd=ROOT)


def figures(trace_dir: Path) -> dict:
    t = read_trace(trace_dir)
    s = summarize(t)
    return {"decode_tok_s": s["decode_tok_s"], "blocked_ms_per_step": s["blocked_ms_per_step"],
            "cpu_ms_per_step": s.get("cpu_ms_per_step"),
            "main_cpu_ms_per_step": s.get("main_cpu_ms_per_step"), **hint.read_times(trace_dir)}


def replayed(trace_dir: Path, scenario: str | None, out: Path) -> dict:
    from sim.compare import compare

    compare(read_trace(trace_dir), scenario=scenario, out=out)
    return figures(out)


def _v(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict) -> str:
    lines = ["| path | regime | readers | decode tok/s measured | simulated | blocked ms/step "
             "measured | simulated | cold prefetch issue to start, ms | start to finish, ms | "
             "CPU ms/step | native's gain measured | simulated |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, rec in results["cases"].items():
        path, regime = case.split(" / ")
        for arm in ARMS:
            m, s = rec["median"][arm]["measured"], rec["median"][arm]["simulated"]
            gain = rec["gain"] if arm == "native" else None
            cells = ["-", "-"] if gain is None else [f"{gain['measured']:.3f}",
                                                     f"{gain['simulated']:.3f}"]
            lines.append(
                f"| {path} | {regime} | {arm} | {m['decode_tok_s']:.1f} | "
                f"{s['decode_tok_s']:.1f} | {m['blocked_ms_per_step']:.2f} | "
                f"{s['blocked_ms_per_step']:.2f} | {_v(m['queue_ms'])} | "
                f"{_v(m['service_ms'])} | {_v(m['cpu_ms_per_step'], 1)} | {cells[0]} | "
                f"{cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    args = lead.replay_arguments(__doc__, "native-reads")
    if not (args.model / "prerouter").is_dir():
        raise SystemExit(f"run.py: {args.model / 'prerouter'}: no prerouter heads (ssdmoe "
                         "train heads)")
    combos = [(c, a) for c in CASES for a in ARMS]
    rows = {c: {a: {"measured": [], "simulated": []} for a in ARMS} for c in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        scenario = lead.scenario_file(args.profiles.resolve() if args.profiles else None,
                                      Path(tmp), args.model_profile and
                                      args.model_profile.resolve())
        for rnd in range(args.rounds):
            shift = (rnd * 3) % len(combos)
            for (path, regime), arm in combos[shift:] + combos[:shift]:
                name = f"{path.replace(' ', '-')}.{regime}.{arm}.r{rnd}"
                trace_dir = RUNS / args.tag / name
                capture(args.model, path, regime, trace_dir, ARMS[arm])
                kind = read_trace(trace_dir).run["engine"].get("readers_kind", "")
                if kind.split(":")[0] != arm:
                    raise SystemExit(f"run.py: {trace_dir}: read by {kind!r} readers, not {arm}")
                measured = figures(trace_dir)
                simulated = replayed(trace_dir, scenario, Path(tmp) / "sim")
                rows[(path, regime)][arm]["measured"].append(measured)
                rows[(path, regime)][arm]["simulated"].append(simulated)
                print(f"{path} {regime} {arm} round {rnd}: measured "
                      f"{measured['decode_tok_s']:.1f} tok/s, simulated "
                      f"{simulated['decode_tok_s']:.1f}", flush=True)
    first = RUNS / args.tag / f"{CASES[0][0].replace(' ', '-')}.{CASES[0][1]}.python.r0"
    results = {
        **lead.replay_header("native-reads", args, first),
        "cases": {f"{p} / {r}": {
            "rounds": rows[(p, r)],
            "median": {a: {k: lead.median_figures(v) for k, v in rows[(p, r)][a].items()}
                       for a in ARMS},
            "gain": {k: hint.paired_gain(rows[(p, r)]["native"][k], rows[(p, r)]["python"][k])
                     for k in ("measured", "simulated")}}
            for p, r in CASES}}
    name = "native-reads" + (f"-{args.tag}" if args.tag else "")
    lead.publish(results, table(results), HERE / f"{name}.json", HERE / "README.md", args.tag)
    print(json.dumps({c: v["gain"] for c, v in results["cases"].items()}, indent=1))


if __name__ == "__main__":
    main()
