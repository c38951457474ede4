"""reports/io: the before/after table of one read per expert, from the `ssdmoe bench` JSONs that
reports/io/run.sh writes (each holds both layouts, paired within rounds), with the issue's
targets checked. Writes reports/io/io.json and the tables of reports/io/README.md (between its
markers). The same for another folder of such JSONs (`DIR`, e.g. reports/io/reader-costs,
whose ARM@before is an earlier engine: `ssdmoe bench --before-code`), with the device latency
of the machine they ran on (`--hardware`, a hardware profile).
Usage: uv run python reports/io/summarize.py [DIR] [--hardware TOML]"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HARDWARE = ROOT / "scenarios" / "hardware" / "this-machine.toml"
REGIMES = {"warm": "every expert in the page cache",
           "quarter": "page cache 1/4 of the expert bytes, unthrottled",
           "quarter-r4": "page cache 1/4, unthrottled, 4 reads in flight",
           "quarter-15mbps": "page cache 1/4, reads throttled to 15 MB/s",
           "quarter-100mbps": "page cache 1/4, reads throttled to 100 MB/s"}
ARMS = ("on-demand", "staged", "staged-prerouter")
BEGIN, END = "<!-- tables: summarize.py -->", "<!-- /tables -->"


def _f(v, fmt: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{fmt}}"


def load_runs(folder: Path = HERE) -> list[tuple[str, str, dict]]:
    """(model, regime, bench result) of each MODEL-REGIME.json in `folder`."""
    runs = []
    for path in sorted(folder.glob("*.json")):
        regime = next((r for r in sorted(REGIMES, key=len, reverse=True)
                       if path.stem.endswith("-" + r)), None)
        if regime is None:
            continue  # io.json, or another file
        runs.append((path.stem[: -len(regime) - 1], regime, json.loads(path.read_text())))
    return runs


def row(model: str, regime: str, arm: str, result: dict, latency_ms: float) -> dict:
    s, b = result["summary"][arm], result["summary"].get(arm + "@before", {})
    m = json.loads((Path(result["model"]) / "manifest.json").read_text()) \
        if (Path(result["model"]) / "manifest.json").is_file() else {}
    bundle = m.get("bundle_bytes")
    bandwidth = result["disk_bandwidth_bytes_s"]
    target = 1.5 * (latency_ms + bundle / bandwidth * 1e3) if bundle else None
    return {
        "model": model, "regime": regime, "arm": arm,
        "decode_tok_s": s["decode_tok_s"], "before_tok_s": b.get("decode_tok_s"),
        "over_before_paired": s.get("over_before_paired"),
        "vs_resident_paired": s.get("ratio_paired"),
        "before_vs_resident_paired": b.get("ratio_paired"),
        "of_bound": s.get("of_bound"), "before_of_bound": b.get("of_bound"),
        "prefill_tok_s": s["prefill_tok_s"], "before_prefill_tok_s": b.get("prefill_tok_s"),
        "read_calls_per_load": s.get("read_syscalls_per_load"),
        "before_read_calls_per_load": b.get("read_syscalls_per_load"),
        "device_reads_per_cold_load": s.get("device_reads_per_cold_load"),
        "before_device_reads_per_cold_load": b.get("device_reads_per_cold_load"),
        "cold_load_ms": s.get("cold_load_ms"), "before_cold_load_ms": b.get("cold_load_ms"),
        # at a queue depth above 1: the time some cold read was in flight, per cold load
        "cold_load_covered_ms": s.get("cold_load_covered_ms"),
        "before_cold_load_covered_ms": b.get("cold_load_covered_ms"),
        "cold_reads_in_flight": s.get("cold_reads_in_flight"),
        "cold_load_target_ms": target if regime in ("quarter", "quarter-r4") else None,
        "blocked_ms_per_step": s["blocked_ms_per_step"],
        "before_blocked_ms_per_step": b.get("blocked_ms_per_step"),
        "bundle_bytes": bundle, "disk_bandwidth_bytes_s": bandwidth,
        "manifest_sha256": result.get("manifest_sha256"),
        "before_manifest_sha256": result.get("before_manifest_sha256"),
        "rounds": result["rounds"], "max_tokens": result["max_tokens"],
        "prompts": len(result["prompts"]), "readers": result.get("readers"),
    }


def tables(rows: list[dict]) -> str:
    out = []
    head = ("| model | regime | arm | decode tok/s after / before | paired after/before | "
            "vs resident (paired) after / before | of bound after / before | read calls per "
            "load | device reads per cold load | cold load ms (target) | covered ms per cold "
            "load, after / before (reads in flight) | cold whole-layer prefill tok/s |")
    out += [head, "|" + "---|" * 12]
    for r in rows:
        prefill = (f"{_f(r['prefill_tok_s'], '.0f')} / {_f(r['before_prefill_tok_s'], '.0f')}"
                   if r["arm"] == "staged" and r["regime"] != "warm" else "")
        target = f" ({_f(r['cold_load_target_ms'], '.3f')})" if r["cold_load_target_ms"] else ""
        out.append(
            f"| {r['model']} | {r['regime']} | {r['arm']} | "
            f"{_f(r['decode_tok_s'], '.1f')} / {_f(r['before_tok_s'], '.1f')} | "
            f"{_f(r['over_before_paired'])}x | {_f(r['vs_resident_paired'])}x / "
            f"{_f(r['before_vs_resident_paired'])}x | {_f(r['of_bound'])} / "
            f"{_f(r['before_of_bound'])} | {_f(r['read_calls_per_load'])} / "
            f"{_f(r['before_read_calls_per_load'])} | {_f(r['device_reads_per_cold_load'])} / "
            f"{_f(r['before_device_reads_per_cold_load'])} | "
            f"{_f(r['cold_load_ms'], '.3f')} / {_f(r['before_cold_load_ms'], '.3f')}{target} | "
            f"{_f(r.get('cold_load_covered_ms'), '.3f')} / "
            f"{_f(r.get('before_cold_load_covered_ms'), '.3f')}"
            f"{_in_flight(r.get('cold_reads_in_flight'))} | {prefill} |")
    return "\n".join(out)


def _in_flight(v: float | None) -> str:
    return "" if v is None or v != v else f" ({v:.2f})"


def targets(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        where = f"{r['model']} {r['regime']} {r['arm']}"
        t = r["cold_load_target_ms"]
        if t and r["cold_load_ms"] == r["cold_load_ms"]:
            ok = r["cold_load_ms"] <= t
            lines.append(f"- cold load inside decode, {where}: {r['cold_load_ms']:.3f} ms "
                         f"against 1.5 x (latency + bundle / bandwidth) = {t:.3f} ms: "
                         f"{'met' if ok else 'MISSED'}")
            covered, depth = r.get("cold_load_covered_ms"), r.get("cold_reads_in_flight")
            if covered == covered and covered is not None and depth and depth > 1.05:
                lines.append(f"  - at {depth:.2f} reads in flight, the time some cold read was "
                             f"in flight per cold load: {covered:.3f} ms: "
                             f"{'met' if covered <= t else 'MISSED'}")
        if r["arm"] == "staged-prerouter" and r["regime"] != "warm" and r["of_bound"]:
            lines.append(f"- token lead of the bound, {where}: {r['of_bound']:.2f} (target "
                         f"0.85): {'met' if r['of_bound'] >= 0.85 else 'MISSED'}")
        if r["arm"] == "staged-prerouter" and r["regime"] == "warm":
            want = 0.9 if r["model"].endswith("wide") else 0.85
            v = r["vs_resident_paired"]
            lines.append(f"- warm token lead vs mlx-lm resident (paired), {r['model']}: "
                         f"{v:.2f}x (target {want}x): {'met' if v >= want else 'MISSED'}")
        if r["over_before_paired"] is not None and r["over_before_paired"] < 0.97:
            lines.append(f"- SLOWER than before: {where}: {r['over_before_paired']:.2f}x paired")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path, default=HERE)
    ap.add_argument("--hardware", type=Path, default=HARDWARE,
                    help="the hardware profile whose ssd_latency_ms the cold-load target uses")
    args = ap.parse_args()
    folder, hardware = args.folder.resolve(), args.hardware.resolve()
    for path in (folder, hardware):
        if not path.exists():
            sys.exit(f"reports/io: {path}: no such file or folder")
    latency = tomllib.loads(hardware.read_text())["ssd_latency_ms"]
    rows = [row(model, regime, arm, result, latency)
            for model, regime, result in load_runs(folder)
            for arm in ARMS if arm in result["summary"]]
    order = {k: i for i, k in enumerate(REGIMES)}
    rows.sort(key=lambda r: (r["model"], order.get(r["regime"], 9), ARMS.index(r["arm"])))
    if not rows:
        sys.exit(f"reports/io: no bench JSONs in {folder} (run its run.sh first)")
    source = str(hardware.relative_to(ROOT)) if hardware.is_relative_to(ROOT) else str(hardware)
    (folder / "io.json").write_text(json.dumps({"latency_ms": latency, "latency_source": source,
                                                "rows": rows}, indent=1) + "\n")
    text = tables(rows) + "\n\nTargets:\n" + "\n".join(targets(rows)) + "\n"
    readme = folder / "README.md"
    body = readme.read_text() if readme.is_file() else f"# reports/io\n\n{BEGIN}\n{END}\n"
    head, _, rest = body.partition(BEGIN)
    _, _, tail = rest.partition(END)
    readme.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")
    print(text)


if __name__ == "__main__":
    main()
