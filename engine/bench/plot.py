"""The chart of a benchmark result (`ssdmoe bench`): decode tok/s per arm against its bound,
and prefill tok/s."""

from __future__ import annotations

from pathlib import Path


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["summary"])
    s = result["summary"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(arms))
    a1.bar(x, [s[a]["decode_tok_s"] for a in arms], color="tab:blue", label="measured")
    bounds = [s[a].get("bound_tok_s") for a in arms]
    if all(b is not None for b in bounds):
        a1.scatter(x, bounds, color="black", marker="_", s=600, label="bound", zorder=3)
    a1.set_xticks(list(x), arms, rotation=30, ha="right")
    a1.set_ylabel("decode tok/s (median)")
    top = max([s[a]["decode_tok_s"] for a in arms] + [b or 0 for b in bounds])
    a1.set_ylim(0, 1.25 * top or 1.0)  # room for the legend above the bars (1: all killed)
    a1.legend(loc="upper center", ncol=2)
    for i, a in enumerate(arms):
        if s[a].get("killed") and "step_ms" not in s[a]:
            a1.text(i, 0, "killed", rotation=90, ha="center", va="bottom", color="tab:red")
    a2.bar(x, [s[a].get("prefill_tok_s", 0.0) for a in arms], color="tab:orange")
    a2.set_xticks(list(x), arms, rotation=30, ha="right")
    a2.set_ylabel("prefill tok/s (median)")
    budget = result["page_cache_budget"]
    mem = (result.get("machine_limits") or {}).get("mem_limit")
    fig.suptitle(f"{Path(result['model']).name}: "
                 + (f"memory limit {mem / 2**20:.0f} MiB" if mem is not None else
                    "page cache warm" if budget is None else f"page-cache budget "
                    f"{budget / 2**20:.0f} MiB ({100 * budget / result['expert_bytes']:.0f}% "
                    "of experts)"))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
