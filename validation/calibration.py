"""The calibration subset's named configurations fit the profile: each runs one decode path
with every expert in the page cache (no storage effects), and its measured graph-building time
per decode step, taken inside real decode (concurrent with compute, on this machine's two
cores), sets that path's main-thread cost per layer (`build_ms_per_layer.<path>` in the
scenario's [notes], which `sim compare` uses). `ssdmoe calibrate` measures the same figure in
an isolated loop; in decode it is several times larger here, which is what the held-out
configurations then test. One parameter per path, fitted so that the simulated build of the
calibration configuration equals the measured one:
    new = old + (measured build/step - simulated build/step) / layers
No MLX here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# validation.matrix path -> the engine decode path whose cost it measures
DECODE_PATH = {"on-demand": "exact", "hot": "hot", "staged": "staged"}


def fitted_build(result: dict[str, Any], layers: int, old: float) -> float:
    m = result["measured"]["build_ms_per_step"]
    s = result["simulated"]["build_ms_per_step"]
    return max(old + (m - s) / layers, 0.0)


def current_note(scenario: Path, key: str) -> float | None:
    match = re.search(rf'^"{re.escape(key)}"\s*=\s*"([0-9.eE+-]+)"', scenario.read_text(), re.M)
    return float(match.group(1)) if match else None


def write_note(scenario: Path, key: str, value: float, why: str) -> None:
    """Set `"key" = "value"  # why` in the scenario's [notes] (replacing the line if any)."""
    text = scenario.read_text()
    line = f'"{key}" = "{value:.4f}"  # {why}'
    pattern = re.compile(rf'^"{re.escape(key)}"\s*=.*$', re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: line, text)
    elif re.search(r"^\[notes\]", text, re.M):
        text = text.rstrip("\n") + "\n" + line + "\n"
    else:
        text = text.rstrip("\n") + "\n\n[notes]\n" + line + "\n"
    scenario.write_text(text)


def fit(results: list[dict[str, Any]], scenario: Path) -> dict[str, dict[str, float]]:
    """Fit build_ms_per_layer.<path> from each calibration result; returns what was set."""
    out = {}
    for r in results:
        path = DECODE_PATH.get(r["config"]["path"])
        if path is None or r["config"]["page_cache"] != "all":
            continue
        key = f"build_ms_per_layer.{path}"
        old = current_note(scenario, key)
        if old is None:
            continue
        layers = int(r["layers"])
        new = fitted_build(r, layers, old)
        write_note(scenario, key, new,
                   f"fitted by ssdmoe validate: {r['config']['name']} measured "
                   f"{r['measured']['build_ms_per_step']:.2f} ms of graph building per decode "
                   f"step inside decode (isolated loop: {old:.4f} ms/layer)")
        out[key] = {"before": old, "after": new,
                    "measured_build_ms_per_step": r["measured"]["build_ms_per_step"]}
    return out
