"""Advice out: the table printed, the JSON and the frontier plot written, and the exact
commands that run the recommendation."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from advise.frontier import Advice, Entry
from advise.predict import Setting

MIB = 2**20


def commands(setting: Setting, e: Entry) -> dict[str, str]:
    """`ssdmoe capture` (records a trace: `sim compare` it against this prediction) and
    `ssdmoe serve` for a candidate on the setting's machine."""
    m = setting.model
    flags = e.candidate.capture_flags(m.heads.get(e.candidate.k), m.bundle_bytes,
                                      m.expert_bytes)
    # the prediction has no adapter; serve also loads the model's heads unless told not to
    flags += ["--no-lora"] + (["--no-prerouter"] if e.candidate.arm != "staged-token" else [])
    capture = [f for f in flags if f != "--no-prerouter"] + setting.machine.flags()
    return {"capture": shlex.join(["ssdmoe", "capture", m.where, "--out", "runs/advised",
                                   *capture]),
            "serve": shlex.join(["ssdmoe", "serve", m.where, *flags])}


def quality_text(q: dict[str, Any] | None) -> str:
    return "-" if q is None else f"ppl {q['ppl']:.1f}, top-1 {q['top1']:.3f}"


def best_per_arm(entries: list[Entry]) -> list[Entry]:
    """Each arm's best of `entries` (which come best first), in that order."""
    seen: dict[str, Entry] = {}
    for e in entries:
        seen.setdefault(e.candidate.arm, e)
    return list(seen.values())


def table(advice: Advice, top: int) -> list[list[str]]:
    """Rows: per K, each arm's best allowed candidate, the `top` best of them."""
    rows = []
    for k in sorted(advice.per_k):
        for e in best_per_arm(advice.per_k[k])[:top]:
            r = e.row
            cache = (r.get("page_cache_bytes") or 0) / MIB
            mark = ">" if e is advice.recommended else ("*" if e.frontier else " ")
            rows.append([mark, str(k), e.candidate.arm, ", ".join(e.candidate.settings) or "-",
                         f"{r['decode_tok_s']:.2f}", f"{r.get('prefill_tok_s') or 0:.1f}",
                         f"{e.engine_bytes / MIB:.1f}", f"{cache:.0f}",
                         quality_text(e.quality)])
    return rows


HEADER = ["", "K", "arm", "settings", "decode tok/s", "prefill tok/s", "engine MiB",
          "page cache MiB", "quality (ssdmoe eval)"]


def print_advice(echo, setting: Setting, advice: Advice, how: str, top: int,
                 wall_s: float) -> None:
    m = setting.model
    echo(f"advise: {m.name} on {setting.machine.describe()}, hardware "
         f"{setting.hardware or 'this-machine (calibrated)'}; objective {advice.objective} "
         f"tok/s; {how}, {len(advice.entries)} simulated in {wall_s:.1f} s")
    rows = table(advice, top)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(HEADER)]
    echo("  ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=True)))
    for r in rows:
        echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    echo("(each arm's best per K; > recommended, * on the frontier: no candidate of that K is "
         "both faster and smaller)")
    if advice.recommended is None:
        return
    rec = advice.recommended
    echo(f"recommended: {rec.candidate.label}: {rec.value(advice.objective):.2f} "
         f"{advice.objective} tok/s predicted, engine {rec.engine_bytes / MIB:.1f} MiB")
    echo(f"why: {advice.reason}")
    if rec.row.get("warnings"):  # memory the OS gives up, or the engine pages (sim.sweep)
        echo(f"memory: {rec.row['warnings']}")
    for name, cmd in commands(setting, rec).items():
        echo(f"{name}: {cmd}")


def to_json(setting: Setting, advice: Advice, how: str, wall_s: float,
            command: str) -> dict[str, Any]:
    m = setting.model
    rec = advice.recommended
    return {
        "command": command,
        "model": {"name": m.name, "path": m.where, "profile": m.profile, "k": m.k,
                  "heads": {str(k): v for k, v in m.heads.items()}},
        "machine": {"name": setting.machine.name, "describe": setting.machine.describe(),
                    "flags": setting.machine.flags()},
        "hardware": setting.hardware or "this-machine (calibrated scenario)",
        "sets": setting.sets, "prompt_tokens": setting.prompt_tokens,
        "routing": {str(k): setting.routing_note(k) for k in sorted(advice.per_k)},
        "objective": advice.objective, "search": how, "wall_s": wall_s,
        "recommended": None if rec is None else {**rec.as_dict(), "why": advice.reason,
                                                 "commands": commands(setting, rec)},
        "why_none": advice.reason if rec is None else None,
        "candidates": [e.as_dict() for e in advice.entries],
    }


def plot(advice: Advice, path: Path, title: str, ceiling: int | None = None) -> None:
    """Objective against engine memory, one colour per K, each K's frontier joined, the
    memory ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = advice.objective
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sorted({e.candidate.k for e in advice.entries}):
        mine = [e for e in advice.entries if e.candidate.k == k and e.value(key) > 0]
        if not mine:
            continue
        dots = ax.scatter([e.engine_bytes / MIB for e in mine], [e.value(key) for e in mine],
                          s=10, alpha=0.35, label=f"K={k}")
        front = sorted((e for e in mine if e.frontier), key=lambda e: e.engine_bytes)
        ax.plot([e.engine_bytes / MIB for e in front], [e.value(key) for e in front],
                marker="o", ms=4, color=dots.get_facecolor()[0][:3])
    rec = advice.recommended
    if rec is not None:
        ax.scatter([rec.engine_bytes / MIB], [rec.value(key)], marker="*", s=220, color="k",
                   zorder=5, label=f"recommended: {rec.candidate.label}")
    if ceiling is not None:
        ax.axvline(ceiling / MIB, color="grey", ls="--", lw=1, label="--max-memory")
    ax.set_xlabel("engine memory (MiB, simulated)")
    ax.set_ylabel(f"{key} tok/s (simulated)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out: Path, data: dict[str, Any], advice: Advice, title: str,
          ceiling: int | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "advise.json", out / "frontier.png"]
    paths[0].write_text(json.dumps(data, indent=1) + "\n")
    plot(advice, paths[1], title, ceiling)
    return paths
