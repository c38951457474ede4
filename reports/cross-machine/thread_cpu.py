"""A decode step's CPU by thread, measured and simulated, over every configuration of some runs:
MLX's compute thread (the process less the main and reader threads), the main thread and the
reader threads, as each trace records them (steps columns cpu_ns, main_cpu_ns, reader_cpu_ns)
and as `sim compare` replays them. Reads `ssdmoe validate`'s validation.json (the matrix),
`validate --transfer`'s transfer.json, and reports/transfer/summarize.py's transfer.json (the
curves); prints one table and the median signed error per thread, writes the same as JSON.

Usage: uv run python reports/cross-machine/thread_cpu.py RUN_DIR... [--json OUT]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from contract.errors import BadInput, read_json_object  # noqa: E402
from validation.thread_errors import MIN_MS, THREADS, complete_split, signed_errors  # noqa: E402

KEYS = ("cpu_ms_per_step", "main_cpu_ms_per_step", "reader_cpu_ms_per_step")


def _read(path: Path) -> dict:
    """A run's JSON; one line naming the file where it is not one."""
    try:
        return read_json_object(path)
    except BadInput as err:
        raise SystemExit(f"thread_cpu.py: {err}") from None


def points(run: Path) -> list[tuple[str, dict, dict]]:
    """(point, measured split, simulated split) of every configuration of `run` that has
    all three figures on both sides."""
    found = []

    def add(name: str, measured: dict, simulated: dict) -> None:
        m, s = complete_split(measured), complete_split(simulated)
        if m is not None and s is not None:
            found.append((name, m, s))

    if (run / "validation.json").is_file():
        for r in _read(run / "validation.json").get("results", []):
            add(r["config"]["name"], r["measured"], r["simulated"])
    elif (run / "transfer.json").is_file():
        data = _read(run / "transfer.json")
        if "results" in data:  # validate --transfer
            for r in data["results"]:
                if "failed" not in r:
                    add(r["point"], *({k: r.get(k, {}).get(side) for k in KEYS}
                                      for side in ("measured", "simulated")))
        else:  # the curves: {curve: {point: {metric: {measured, simulated}}}}
            for curve, pts in data.items():
                if curve == "summary":
                    continue
                for name, r in pts.items():
                    add(f"{curve}/{name}", *({k: (r.get(k) or {}).get(side) for k in KEYS}
                                             for side in ("measured", "simulated")))
    else:
        raise SystemExit(f"thread_cpu.py: {run}: no validation.json or transfer.json")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for run in args.runs:
        try:
            rows += [(run.name, *p) for p in points(run)]
        except (KeyError, TypeError, AttributeError) as err:
            raise SystemExit(f"thread_cpu.py: {run}: its JSON is not a validate, validate "
                             f"--transfer or curves run ({type(err).__name__}: {err})") from None
    if not rows:
        raise SystemExit("thread_cpu.py: no configuration records the readers' CPU "
                         "(traces captured before reader_cpu_ns)")
    print("| run | point | " + " | ".join(f"{t} ms/step m / s" for t in THREADS) + " |")
    print("|---|---|" + "---|" * len(THREADS))
    for run, name, m, s in rows:
        print(f"| {run} | {name} | "
              + " | ".join(f"{m[t]:.2f} / {s[t]:.2f}" for t in THREADS) + " |")
    summary = signed_errors((m, s) for _, _, m, s in rows)
    print("\nmedian signed error, simulated against measured (where measured >= "
          f"{MIN_MS} ms a step): " + ", ".join(
              f"{t} {v['median_signed_error_pct']:+.1f}% ({v['points']})"
              for t, v in summary.items() if v["median_signed_error_pct"] is not None))
    if args.json:
        args.json.write_text(json.dumps({
            "runs": [str(r) for r in args.runs], "summary": summary,
            "points": [{"run": run, "point": name, "measured": m, "simulated": s}
                       for run, name, m, s in rows]}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
