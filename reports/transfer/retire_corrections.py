"""The held-out comparison that retired the scheduler corrections (reports/transfer/retired.md):
on a worktree of the commit before they went (5e47eb5d), each correction group is set to its
neutral value in scenarios/hardware/this-machine.toml, then the committed traces are predicted
again, the same-machine matrix (`validate --rounds 5 --recompare`, its fits redone) and the
transfer points (`validate --transfer`, no refit), and the errors are printed. No capture runs.

    git worktree add /tmp/abl 5e47eb5d && ln -s $PWD/models /tmp/abl/models
    python reports/transfer/retire_corrections.py /tmp/abl [GROUP ...]   # ~1.5 min a group
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

STALL = ["stall_points_ms", "stall_wake_main_ms", "stall_wake_compute_ms", "busy_stall_points_ms",
         "busy_stall_compute_ms", "sync_stall_points_ms", "sync_stall_wake_main_ms",
         "sync_stall_wake_compute_ms"]
IDLE = ["idle_util_points", "idle_slowdown", "sync_idle_util_points", "sync_idle_slowdown"]
GROUPS: dict[str, dict[str, str | None]] = {
    "none": {},
    "stall": dict.fromkeys(STALL, "[]"),
    "idle": dict.fromkeys(IDLE, "[]"),
    "reader_weight": {"reader_cpu_weight": "1.0"},
    "core_wait": {"core_wait_ms": "0.0"},
    "queue_speedup": {"queue_speedup": "[]"},
    "gil_handoff": {"gil_handoff_ms": "0.0"},
    "refused_warm": {"refused_warm_ms": "0.0"},
    "queue_ahead": {"queue_ahead_ms": None},  # None: the key left out (its default)
}
GROUPS["retired"] = {**GROUPS["stall"], **GROUPS["idle"], **GROUPS["reader_weight"],
                     **GROUPS["core_wait"], **GROUPS["queue_speedup"]}


def neutral(text: str, values: dict[str, str | None]) -> str:
    out = []
    for line in text.splitlines():
        m = re.match(r"^(\w+)\s*=", line)
        if m and m.group(1) in values:
            if values[m.group(1)] is None:
                continue
            line = f"{m.group(1)} = {values[m.group(1)]}  # neutral"
        out.append(line)
    return "\n".join(out) + "\n"


def main(root: Path, groups: list[str]) -> None:
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        sys.exit(f"retire_corrections: unknown group {', '.join(unknown)} (known: "
                 f"{', '.join(GROUPS)})")
    hw = root / "scenarios/hardware/this-machine.toml"
    if not hw.is_file():
        sys.exit(f"retire_corrections: {root}: no scenarios/hardware/this-machine.toml (a "
                 "worktree of 5e47eb5d, see the module doc)")
    original = hw.read_text()
    cli = [sys.executable, "-m", "ssdmoe_cli", "validate"]
    try:
        for group in groups:
            hw.write_text(neutral(original, GROUPS[group]))
            subprocess.run([*cli, "--rounds", "5", "--recompare", "--no-calibrate"], cwd=root,
                           capture_output=True, check=True)
            subprocess.run([*cli, "models/tiny-trained-stream", "--transfer",
                            "scenarios/transfer/machines.toml", "--no-calibrate", "--rounds", "2"],
                           cwd=root, capture_output=True, check=True)
            same = json.loads((root / "reports/validation/validation.json").read_text())["summary"]
            moved = json.loads((root / "reports/transfer/validate/transfer.json").read_text())[
                "summary"]
            d = same["decode_tok_s"]
            parts = " / ".join(f"{same[k]['median_ape_pct']:.1f}" for k in (
                "build_ms_per_step", "eval_ms_per_step", "blocked_ms_per_step"))
            print(f"| {group} | {d['median_ape_pct']:.1f}% / {d['p90_ape_pct']:.1f}% | {parts} | "
                  f"{moved['decode_abs_error_median_pct']:.1f}% / "
                  f"{moved['decode_abs_error_p90_pct']:.1f}% | "
                  f"{moved['component_abs_error_median_pct']:.1f}% |", flush=True)
    finally:
        hw.write_text(original)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or list(GROUPS))
