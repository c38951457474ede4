"""How long a full `ssdmoe advise` search takes: `uv run python reports/advise/speed.py`.

Each case is one model on one machine, searched at its default settings (every arm at the
model's own K: exhaustive), run `--rounds` times in rotation; the figure is the command's wall
time (process start to exit, the search, JSON and plot included) and the search's own time
(advise.json wall_s). Target: at most 60 s on 2 cores. Writes reports/advise/speed.json and
prints the table."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "tiny-trained, this machine": ["models/tiny-trained-stream"],
    "tiny-trained-wide, one core": ["models/tiny-trained-wide-stream", "--machines",
                                    "scenarios/advise/machines.toml", "--machine", "one-core"],
    "edge0-35b, M2 16 GB": ["edge0-35b", "--hardware", "m2-16gb", "--set", "overlap=0.25",
                            "--set", "skew=2.35"],
}
TARGET_S = 60.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    names = list(CASES)
    got: dict[str, list[tuple[float, float, int]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                out = Path(tmp) / f"{len(got[name])}-{name.split(',')[0]}"
                cmd = [sys.executable, "-m", "ssdmoe_cli", "advise", *CASES[name], "--out",
                       str(out)]
                started = time.perf_counter()
                subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
                wall = time.perf_counter() - started
                data = json.loads((out / "advise.json").read_text())
                got[name].append((wall, data["wall_s"], len(data["candidates"])))
    rows = [{"case": n, "command": "ssdmoe advise " + " ".join(CASES[n]),
             "candidates": got[n][0][2], "wall_s": [w for w, _, _ in got[n]],
             "search_s": [s for _, s, _ in got[n]],
             "wall_s_median": statistics.median(w for w, _, _ in got[n]),
             "met": statistics.median(w for w, _, _ in got[n]) <= TARGET_S} for n in names]
    result = {"cores": os.cpu_count(), "target_s": TARGET_S, "rounds": args.rounds,
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    (ROOT / "reports" / "advise" / "speed.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| case | candidates | wall s (median) | search s (median) | <= 60 s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['candidates']} | {r['wall_s_median']:.1f} | "
              f"{statistics.median(r['search_s']):.1f} | {'yes' if r['met'] else 'no'} |")


if __name__ == "__main__":
    main()
