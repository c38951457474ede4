"""Measured against simulated on emulated machines: every trace that reports/transfer/run.sh
captured (traces/<curve>/<point>.r<round>) is replayed with `ssdmoe sim compare` on the
committed profiles (nothing refitted), and each point's medians over rounds are put side by
side. Writes transfer.json, README.md's tables (between the markers) and one PNG per curve.
Usage: python reports/transfer/summarize.py"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COMPONENTS = ("decode_tok_s", "blocked_ms_per_step", "build_ms_per_step", "eval_ms_per_step",
              "cold_fraction")
# a decode step's CPU by thread (kept in transfer.json: reports/cross-machine/thread_cpu.py)
CPU = ("cpu_ms_per_step", "main_cpu_ms_per_step", "reader_cpu_ms_per_step")
BEGIN, END = "<!-- tables: summarize.py -->", "<!-- end tables -->"


def compare(trace: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "ssdmoe_cli", "sim", "compare", str(trace),
                        "--json"], capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{trace}: sim compare failed: {p.stderr.strip()[-300:]}")
    d = json.loads(p.stdout)
    out = {}
    for key in COMPONENTS:
        if key in d["metrics"]:
            out[key] = (d["metrics"][key]["measured"], d["metrics"][key]["simulated"])
        else:  # the build/eval split lives in the sim section
            out[key] = (d["sim"][f"measured_{key}"], d["sim"][key])
    for key in CPU:
        metric = d["metrics"].get(key) or {}
        out[key] = (metric.get("measured"), metric.get("simulated"))
    # a cold read's time (mean, every thread; None without one), and the main thread's loads
    out["cold_read_ms"] = (d["sim"]["measured_cold_read_ms"], d["sim"]["cold_read_ms"])
    out.update(main_loads(trace))
    return out


def main_loads(trace: Path) -> dict[str, tuple[float | None, None]]:
    """The measured median ms of the decode steps' expert loads on the main thread, cold and
    warm (the trace's load rows, finished - started); not simulated per thread."""
    import polars as pl

    from traces.reader import read_trace

    t = read_trace(trace)
    decode = t.steps.filter(pl.col("phase") == "decode")["step"]
    loads = t.loads.filter(pl.col("step").is_in(decode) & (pl.col("expert") >= 0)
                           & (pl.col("thread") == "main"))
    ms = ((loads["finished_ns"] - loads["started_ns"]) / 1e6).to_list()
    cold = loads["cold"].to_list()
    return {f"main_{kind}_load_ms": (_median([v for v, c in zip(ms, cold, strict=True)
                                              if c == want]), None)
            for kind, want in (("cold", True), ("warm", False))}


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def points(curve_dir: Path) -> dict[str, dict]:
    """point name -> {metric: {"measured": median, "simulated": median, "rounds": n}}."""
    runs: dict[str, list[dict]] = {}
    for trace in sorted(curve_dir.glob("*.r*")):
        run = trace / "run.json"
        if not run.is_file() or not json.loads(run.read_text()).get("complete"):
            continue
        runs.setdefault(re.sub(r"\.r\d+$", "", trace.name), []).append(compare(trace))
    out = {}
    for name, rows in runs.items():
        out[name] = {k: {"measured": _median(r[k][0] for r in rows),
                         "simulated": _median(r[k][1] for r in rows)}
                     for k in rows[0]}
        out[name]["rounds"] = len(rows)
    return out


def err(p: dict, key: str = "decode_tok_s") -> float:
    m, s = p[key]["measured"], p[key]["simulated"]
    return 100 * (s / m - 1) if m else float("nan")


def pair(p: dict, k: str, fmt: str = ".1f") -> str:
    return f"{p[k]['measured']:{fmt}} / {p[k]['simulated']:{fmt}}"


def table(pts: dict[str, dict]) -> list[str]:
    lines = ["| point | rounds | decode tok/s measured | simulated | error | blocked ms/step "
             "measured / simulated | build ms/step | eval ms/step | cold fraction | cold read ms "
             "| main-thread load ms, cold / warm (measured) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in pts.items():
        main = " / ".join(_ms(p.get(f"main_{kind}_load_ms", {}).get("measured"))
                          for kind in ("cold", "warm"))
        lines.append(f"| {name} | {p['rounds']} | {p['decode_tok_s']['measured']:.2f} | "
                     f"{p['decode_tok_s']['simulated']:.2f} | {err(p):+.0f}% | "
                     f"{pair(p, 'blocked_ms_per_step')} | {pair(p, 'build_ms_per_step')} | "
                     f"{pair(p, 'eval_ms_per_step')} | {pair(p, 'cold_fraction', '.2f')} | "
                     f"{_ms(p['cold_read_ms']['measured'])} / {_ms(p['cold_read_ms']['simulated'])}"
                     f" | {main} |")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def gains(pts: dict[str, dict], tags: list[str]) -> list[str]:
    """The prerouter's gain (staged-token over on-demand) per machine, measured and simulated."""
    lines = ["| machine | gain measured | gain simulated |", "|---|---|---|"]
    for tag in tags:
        a, b = pts.get(f"staged-token-{tag}"), pts.get(f"on-demand-{tag}")
        if a and b:
            g = [a["decode_tok_s"][w] / b["decode_tok_s"][w] for w in ("measured", "simulated")]
            lines.append(f"| {tag} | {g[0]:.2f}x | {g[1]:.2f}x |")
    return lines


def mem_mib(tag: str) -> float:
    return float(tag[:-1]) * (1024 if tag.endswith("G") else 1)


def _save(fig, ax, title: str, path: Path) -> None:
    """Decode tok/s from 0, the title and legend, written to `path`."""
    import matplotlib.pyplot as plt

    ax.set_ylabel("decode tok/s (median of rounds)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(pts: dict[str, dict], tags: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, color in (("on-demand", "tab:blue"), ("staged-token", "tab:green")):
        xs = [mem_mib(t) for t in tags if f"{arm}-{t}" in pts]
        for who, style in (("measured", "-o"), ("simulated", "--x")):
            ys = [pts[f"{arm}-{t}"]["decode_tok_s"][who] for t in tags if f"{arm}-{t}" in pts]
            ax.plot(xs, ys, style, color=color, label=f"{arm} {who}")
    ax.set_xlabel("memory limit (MiB): the process and its page cache")
    _save(fig, ax, "tiny-trained-wide under a memory cgroup", path)


def plot_hot(pts: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(pts, key=lambda n: mem_mib(n.split("-", 1)[1]))
    xs = [mem_mib(n.split("-", 1)[1]) for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    for who, style in (("measured", "-o"), ("simulated", "--x")):
        ax.plot(xs, [pts[n]["decode_tok_s"][who] for n in names], style, label=who)
    ax.set_xlabel("hot path LRU (MiB), under a 1000 MiB memory limit")
    _save(fig, ax, "tiny-trained-wide: the app cache takes from the page cache", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path, default=HERE,
                    help="the run's folder: traces/<curve>/<point>.r<round> in it")
    where = ap.parse_args().folder.resolve()
    traces = where / "traces"
    if not traces.is_dir():
        raise SystemExit(f"{traces}: no such folder (reports/transfer/run.sh captures it)")
    memory = points(traces / "memory")
    cores = points(traces / "cores")
    hot = points(traces / "hot")
    hot = {n: hot[n] for n in sorted(hot, key=lambda n: mem_mib(n.split("-", 1)[1]))}
    mem_tags = sorted({n.rsplit("-", 1)[1] for n in memory}, key=mem_mib, reverse=True)
    memory = {f"{arm}-{t}": memory[f"{arm}-{t}"] for arm in ("on-demand", "staged-token")
              for t in mem_tags if f"{arm}-{t}" in memory}
    core_tags = [t for t in ("base", "cpus1", "quota0.5")
                 if any(n.endswith(t) for n in cores)]
    held = [abs(err(p)) for p in [*memory.values(), *cores.values(), *hot.values()]]
    summary = {"points": len(held),
               "decode_abs_error_median_pct": statistics.median(held) if held else None,
               "decode_abs_error_max_pct": max(held) if held else None}
    (where / "transfer.json").write_text(json.dumps(
        {"memory": memory, "cores": cores, "hot": hot, "summary": summary}, indent=1) + "\n")
    if memory:
        plot_memory(memory, mem_tags, where / "memory.png")
    if hot:
        plot_hot(hot, where / "hot.png")
    body = ["### Memory limit (tiny-trained-wide, no page-cache budget)", "", *table(memory),
            "", "The prerouter's gain against the memory limit:", "",
            *gains(memory, mem_tags), "", "### Cores and CPU time (tiny-trained, page-cache "
            "budget 1/4)", "", *table(cores), "", "The prerouter's gain per machine:", "",
            *gains(cores, core_tags), "",
            "### The app cache against the page cache (tiny-trained-wide, hot path, 1000 MiB "
            "limit)", "", *table(hot), "",
            f"Decode tok/s over {summary['points']} points: median absolute error "
            f"{summary['decode_abs_error_median_pct']:.1f}%, largest "
            f"{summary['decode_abs_error_max_pct']:.1f}%." if held else "No points yet."]
    readme = where / "README.md"
    text = readme.read_text() if readme.is_file() else f"{BEGIN}\n{END}\n"
    if text.find(BEGIN) < 0 or text.find(END) < text.find(BEGIN):
        sys.exit(f"reports/transfer: {readme}: its table markers are missing or out of order "
                 f"(the tables go between {BEGIN} and {END})")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(head + BEGIN + "\n" + "\n".join(body) + "\n" + END + tail)
    print("\n".join(body))


if __name__ == "__main__":
    main()
