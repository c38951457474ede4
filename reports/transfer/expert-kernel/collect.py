"""Paired: one calibration and one set of captures, re-predicted by two or more simulators.

Each arm is a worktree of a commit (the simulator under test) whose scenarios/ hold the
calibration's profiles; in it `ssdmoe validate --recompare --no-calibrate` refits the in-decode
figures on the calibration's own captures (same machine), `ssdmoe validate --transfer ...
--no-calibrate` re-predicts the emulated machines and the held-out model, and
reports/transfer/summarize.py the curves. This script reads the three outputs of each arm and
writes results.json beside it, printing the table.

Usage: python reports/transfer/expert-kernel/collect.py CALIBRATION:ARM:DIR [...]
(DIR holds val/validation.json, tr/transfer.json, cu/transfer.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def arm_figures(d: Path) -> dict[str, float]:
    val = json.loads((d / "val" / "validation.json").read_text())["summary"]["decode_tok_s"]
    tr = json.loads((d / "tr" / "transfer.json").read_text())["summary"]
    cu = json.loads((d / "cu" / "transfer.json").read_text())["summary"]
    return {"same_machine_median_pct": val["median_ape_pct"],
            "same_machine_p90_pct": val["p90_ape_pct"],
            "transfer_median_pct": tr["decode_abs_error_median_pct"],
            "transfer_p90_pct": tr["decode_abs_error_p90_pct"],
            "transfer_components_pct": tr["component_abs_error_median_pct"],
            "curves_median_pct": cu["decode_abs_error_median_pct"],
            "curves_largest_pct": cu["decode_abs_error_max_pct"]}


def main(specs: list[str]) -> None:
    rows = []
    for spec in specs:
        calibration, arm, d = spec.rsplit(":", 2)
        rows.append({"calibration": calibration, "arm": arm, **arm_figures(Path(d))})
    (HERE / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("| calibration | simulator | same machine median / p90 | transfer median / p90 / "
          "components | curves median / largest |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['calibration']} | {r['arm']} | {r['same_machine_median_pct']:.1f}% / "
              f"{r['same_machine_p90_pct']:.1f}% | {r['transfer_median_pct']:.1f}% / "
              f"{r['transfer_p90_pct']:.1f}% / {r['transfer_components_pct']:.1f}% | "
              f"{r['curves_median_pct']:.1f}% / {r['curves_largest_pct']:.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1:])
