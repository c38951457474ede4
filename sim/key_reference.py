"""docs/simulator.md, generated from the config dataclasses' own metadata (sim.scenario `key`:
what each key means and how to obtain it; the unit is read off the name's suffix), so the
reference cannot drift from the code: tests/test_key_reference.py checks that the committed file
is current, and `ssdmoe sim keys --write docs/simulator.md` regenerates it."""

from __future__ import annotations

import math
from dataclasses import MISSING, fields

from sim.scenario import Hardware, ModelProfile, Scenario

HIDDEN = ("name", "hardware", "model", "source", "description")
# name suffix -> unit, longest first
UNITS = (("_us_per_page", "µs per 4 KiB page"), ("_per_token", "bytes per token"),
         ("_per_layer", "ms per layer"), ("_ms_per_load", "ms per bundle loaded"),
         ("_gib", "GiB (2^30 bytes)"),
         ("_gbps", "GB/s (10^9 bytes/s)"), ("_mbps", "MB/s (10^6 bytes/s)"),
         ("_tflops", "TFLOP/s"), ("_bytes", "bytes"), ("_ms", "ms"), ("_s", "s"),
         ("_iops", "requests/s"), ("_cores", "cores"))
SECTIONS = (
    (Hardware, "Hardware profile", "`scenarios/hardware/*.toml`: one machine. `ssdmoe calibrate` "
     "writes this machine's, each value with how it was measured."),
    (ModelProfile, "Model profile", "`scenarios/models/*.toml`: one model, from its manifest "
     "(`ssdmoe sim profile-model MODEL`), its prerouter heads and its captured traces."),
    (Scenario, "Scenario", "`scenarios/*.toml`: a hardware profile, a model profile and the "
     "engine and run settings; any key can be overridden with `--set key=value`."),
)


def unit(name: str, kind: type | str) -> str:
    for suffix, text in UNITS:
        if name.endswith(suffix):
            return text
    kind = str(kind)
    if "bool" in kind:
        return "true/false"
    if "list" in kind:
        return "list"
    if "dict[str, float]" in kind:
        return "table of numbers"
    if "str" in kind:
        return "text"
    return "count" if "int" in kind else "-"


def _default(f) -> str:
    if f.default is not MISSING:
        v = f.default
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        return "(required)" if v is None else f"`{v!r}`".replace("'", '"')
    if f.default_factory is not MISSING:
        return f"`{f.default_factory()!r}`"
    return "(required)"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    lines = ["# Simulator keys", "",
             "Every key of a hardware profile, a model profile and a scenario: its unit, what "
             "it means, its default, and how to obtain it. Generated from the dataclasses in "
             "`sim/scenario.py` by `uv run ssdmoe sim keys --write docs/simulator.md`; "
             "`tests/test_key_reference.py` fails when this file is not current.", ""]
    for cls, title, where in SECTIONS:
        shown = [f for f in fields(cls) if f.name not in HIDDEN]
        lines += [f"## {title} ({len(shown)} keys)", "", where, "",
                  "| key | unit | default | meaning | how to obtain it |",
                  "|---|---|---|---|---|"]
        for f in shown:
            lines.append(f"| `{f.name}` | {unit(f.name, f.type)} | {_default(f)} | "
                         f"{_cell(f.metadata.get('help', ''))} | "
                         f"{_cell(f.metadata.get('obtain', ''))} |")
        lines.append("")
    return "\n".join(lines)
