"""The expert kernel's rate on each converted model's real experts against calibrate's size
curve read at that model's bundle size: does the synthetic curve predict a model it was not
shaped from? Rounds alternate the probes; medians over rounds.

Usage: python reports/transfer/expert-kernel/kernel_rates.py [--rounds 2]; writes
kernel-rates.json beside this script and prints the table."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from calibration.compute_probes import expert_kernel_gbps
from calibration.expert_size_probe import expert_size_curve
from calibration.profile_values import expert_rate_gbps
from engine.loader import open_manifest
from sim.rate_curve import rate_at

HERE = Path(__file__).resolve().parent
CALIBRATION = Path("models/tiny-trained-stream")
HELD_OUT = Path("models/tiny-trained-wide-stream")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    rounds = ap.parse_args().rounds
    sizes = {m: open_manifest(m, verify=False).bundle_bytes for m in (CALIBRATION, HELD_OUT)}
    runs = []
    for _ in range(rounds):
        real = {str(m): expert_kernel_gbps(m) for m in (CALIBRATION, HELD_OUT)}
        curve = expert_size_curve(CALIBRATION)
        xs = [s for s, _ in curve]
        ys = [expert_rate_gbps(ms, s) for s, ms in curve]
        synthetic = {str(m): rate_at(xs, ys, sizes[m]) for m in sizes}
        runs.append({"real_gbps": real, "curve_gbps": synthetic,
                     "curve": list(zip(xs, ys, strict=True))})
    med = {kind: {str(m): statistics.median(r[kind][str(m)] for r in runs) for m in sizes}
           for kind in ("real_gbps", "curve_gbps")}
    ratio_real = med["real_gbps"][str(HELD_OUT)] / med["real_gbps"][str(CALIBRATION)]
    ratio_curve = med["curve_gbps"][str(HELD_OUT)] / med["curve_gbps"][str(CALIBRATION)]
    out = {"command": "python reports/transfer/expert-kernel/kernel_rates.py --rounds "
                      f"{rounds}", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "bundle_bytes": {str(m): b for m, b in sizes.items()}, "medians": med,
           "held_out_over_calibration": {"real": ratio_real, "curve": ratio_curve},
           "runs": runs}
    (HERE / "kernel-rates.json").write_text(json.dumps(out, indent=1) + "\n")
    print("| model | bundle bytes | real kernel GB/s | curve GB/s |")
    print("|---|---|---|---|")
    for m in sizes:
        print(f"| {m.name} | {sizes[m]} | {med['real_gbps'][str(m)]:.3f} | "
              f"{med['curve_gbps'][str(m)]:.3f} |")
    print(f"held-out / calibration model: real {ratio_real:.3f}, curve {ratio_curve:.3f}")


if __name__ == "__main__":
    main()
