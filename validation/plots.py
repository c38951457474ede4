"""The validation report's figures: measured vs simulated scatter, error per configuration,
and the worst configuration's measured and simulated step timelines (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from validation.labels import LABELS


def plot_scatter(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    for ax, key in zip(axes, ("decode_tok_s", "blocked_ms_per_step", "step_ms_p50"),
                       strict=True):
        xs, ys, cs = [], [], []
        for r in results:
            m, s = r["measured"].get(key), r["simulated"].get(key)
            if m is None or s is None:
                continue
            xs.append(m)
            ys.append(s)
            cs.append("tab:orange" if r["config"]["role"] == "calibration" else "tab:blue")
        ax.scatter(xs, ys, c=cs, s=28, zorder=3)
        top = max(xs + ys + [1e-9]) * 1.1
        ax.plot([0, top], [0, top], color="black", lw=0.8, label="y = x")
        ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="gray", alpha=0.15,
                        label="within 10%")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel(f"measured {LABELS[key]}")
        ax.set_ylabel(f"simulated {LABELS[key]}")
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("simulated vs measured (blue: held out, orange: calibration)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_errors(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"]["name"] for r in results]
    keys = ("decode_tok_s", "blocked_ms_per_step", "build_ms_per_step", "eval_ms_per_step")
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(names) + 3), 4.8))
    x = np.arange(len(names))
    w = 0.8 / len(keys)
    for i, k in enumerate(keys):
        signed = []
        for r in results:
            m, s = r["measured"].get(k), r["simulated"].get(k)
            signed.append(100 * (s - m) / m if m and s is not None else np.nan)
        ax.bar(x + (i - 1.5) * w, signed, w, label=LABELS[k])
    ax.axhline(0, color="black", lw=0.8)
    for lim in (-10, 10):
        ax.axhline(lim, color="gray", lw=0.6, ls="--")
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("simulated vs measured, % (signed)")
    ax.legend(fontsize=8, ncol=4)
    ax.set_title("error per configuration (dashed: +-10%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def step_window(trace, step: int) -> tuple[dict, Any]:
    import polars as pl

    row = trace.steps.filter(pl.col("step") == step).row(0, named=True)
    loads = trace.loads.filter((pl.col("finished_ns") >= row["start_ns"])
                               & (pl.col("issued_ns") <= row["end_ns"]))
    return row, loads


def draw_step(ax, trace, step: int, title: str) -> float:
    """One decode step: its components stacked (the trace holds build/eval totals, not their
    positions), then where the main thread waited, then each thread's loads in time."""
    row, loads = step_window(trace, step)
    t0 = row["start_ns"]
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731
    build, blocked = row["build_ns"] / 1e6, (row["blocked_ns"] or 0) / 1e6
    evaluation = row["eval_ns"] / 1e6
    ax.barh(0, build, left=0, color="tab:blue")
    ax.barh(0, evaluation, left=build, color="lightgray")
    ax.barh(0, blocked, left=build + evaluation, color="tab:red")
    for ld in loads.iter_rows(named=True):
        if ld["wait_ns"]:
            ax.barh(1, ld["wait_ns"] / 1e6, left=ms(ld["finished_ns"] - ld["wait_ns"]),
                    color="tab:red")
    threads = sorted(set(loads["thread"].to_list()), key=lambda t: (t != "main", t))
    lane = {t: i + 2 for i, t in enumerate(threads)}
    for ld in loads.iter_rows(named=True):
        start = ld["started_ns"] if ld["started_ns"] is not None else ld["issued_ns"]
        ax.barh(lane[ld["thread"]], max(ms(ld["finished_ns"]) - ms(start), 0.005),
                left=ms(start), height=0.6, color="tab:red" if ld["cold"] else "tab:green")
    ax.set_yticks(range(len(threads) + 2),
                  ["components", "main waits"] + [f"loads: {t}" for t in threads], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from window start")
    ax.set_title(title, fontsize=9)
    return ms(row["end_ns"])


def plot_timelines(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import polars as pl
    from matplotlib.patches import Patch

    from traces.reader import read_trace

    measured = read_trace(Path(result["trace"]))
    simulated = read_trace(Path(result["simulated_trace"]))
    d = measured.steps.filter(pl.col("phase") == "decode")
    dur = (d["end_ns"] - d["start_ns"]).to_numpy()
    step = int(d["step"][int(np.argsort(dur)[len(dur) // 2])])  # the median-length step
    fig, axes = plt.subplots(2, 1, figsize=(11, 6))
    spans = [draw_step(axes[0], measured, step, f"measured, decode step {step} (median "
                        "length)")]
    if step in set(simulated.steps["step"].to_list()):
        spans.append(draw_step(axes[1], simulated, step, f"simulated, the same step {step}"))
    for ax in axes:
        ax.set_xlim(0, max(spans) * 1.02)
    handles = [Patch(color="tab:blue", label="graph build"),
               Patch(color="lightgray", label="evaluation"),
               Patch(color="tab:red", label="blocked on loads / a cold load"),
               Patch(color="tab:green", label="warm load")]
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=4)
    fig.suptitle(f"worst configuration: {result['config']['name']}", x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
