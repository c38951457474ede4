"""Reproduce the edge0 paper's streaming results from its component figures (issue 5, item 5).

    uv run python reports/paper/predict_paper.py    # writes reports/paper/README.md + paper.json

1. derive profile values in closed form from digest figures (printed, and checked against the
   committed TOML files, which are what every prediction uses);
   The M2's OS reserve is one of them: its page cache at the kernel's floor beside the engine's
   peak, from both arms' cold fractions (no tok/s enters it);
2. calibrate the one value the digest gives no direct figure for from ONE component figure of
   the on-demand K=4 arm on the M2: routing skew (bytes/step 50.9 MiB);
3. predict, with `sim run` exactly as the CLI runs it: on-demand vs prerouter at K=2, 4, 8 on
   the M2 16 GB, K=4 on the M4 Pro 24 GB and Table 1's second tier (edge0-8b, K=8, both
   LRU sizes the digest gives) on it; plus what-ifs. K=2 and K=8 are not in the digest
   on purpose: they are predictions, nothing was tuned toward them.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sim.memory_budget import budget  # noqa: E402
from sim.profiles import load_scenario  # noqa: E402
from sim.replay import run_scenario  # noqa: E402
from sim.scenario import GIB, MIB  # noqa: E402

OUT = Path(__file__).resolve().parent
SEEDS = (0, 1, 2)
KEYS = ("decode_tok_s", "blocked_ms_per_step", "loads_per_step", "mib_per_load",
        "cold_fraction", "mib_per_step", "step_ms_p50")

# The digest's figures (../shared/reference/edge0-paper-digest.md).
PAPER = {
    "m2_k4": {"on-demand": {"decode_tok_s": 3.5, "blocked_ms_per_step": 244.0,
                            "mib_per_step": 50.9, "mib_per_load": 0.27, "cold_fraction": 0.17},
              "prerouter": {"decode_tok_s": 6.4, "blocked_ms_per_step": 101.9,
                            "mib_per_step": 58.9, "mib_per_load": 1.32, "cold_fraction": 0.84}},
    "m4pro_k4": {"on-demand": {"decode_tok_s": 19.9}, "prerouter": {"decode_tok_s": 20.4}},
    "load_cost_ms": (1.17, 1.33),
    "graph_build_ms_per_step": 44.0,
    "disk_share_max": 0.12,
    "peak_active_gib": 2.9,
    "k8_stager_fill_ms_per_step": 62.5,
    # Table 1's second tier on the M4 Pro, K=8, with the prerouter: the 64-bundle shared LRU,
    # and the 1,024-bundle LRU that "costs ~0.9 GiB more"
    "m4pro_8b": {"prerouter": 28.0, "prerouter_lru1024": 31.8, "peak_active_gib": 1.5,
                 "lru1024_extra_gib": 0.9},
}

# edge0-8b's two LRU sizes (digest: 64 and 1,024 bundles), as --set items
LRU_8B = {"lru64": [], "lru1024": ["lru_bytes=1363652608"]}


# OS reserves the M2 K=4 arms are shown at (section "How the M2's OS reserve moves them"): the
# M4 Pro's lower bound, the derived figure and around it.
RESERVES_GIB = (5.8, 9.0, 11.0, 12.0, 12.58, 13.2)

# The paper's two arms in the engine's vocabulary: its staged path on demand, or with the
# prediction heads' one-token lead (sim.policies).
ARMS = {"on-demand": "lead=none", "prerouter": "lead=token"}


def run(name: str, sets: list[str], seeds=SEEDS) -> dict[str, Any]:
    """Median over seeds of the summary metrics (seed 0 is what the CLI command prints)."""
    runs = [run_scenario(load_scenario(name, [*sets, f"seed={s}"])) for s in seeds]
    out: dict[str, Any] = {}
    for key in KEYS:
        values = [r.metrics[key] for r in runs]
        out[key] = statistics.median(values)
        out[key + "_seed0"] = values[0]
        out[key + "_range"] = [min(values), max(values)]
    out["page_cache_gib"] = runs[0].figures.page_cache_capacity_bytes / GIB
    memory = runs[0].figures.as_dict()["memory"]
    out["swapped_fraction"] = memory["swapped_fraction"]
    out["os_held_gib"] = memory["os_held"] / GIB
    out["page_cache_hit_rate"] = runs[0].figures.page_cache_hit_rate
    out["lru_hit_rate"] = runs[0].figures.lru_hit_rate
    out["eval_ms_per_step"] = runs[0].figures.eval_ms_per_step
    out["build_ms_per_step"] = runs[0].figures.build_ms_per_step
    out["warnings"] = runs[0].figures.warnings
    return out


def derive() -> dict[str, Any]:
    """Closed-form derivations from digest figures (section 1 of the report)."""
    sc = load_scenario("paper-m2-16gb")
    m = sc.model
    bundle_mib = m.bundle_bytes / MIB
    warm, cold = PAPER["load_cost_ms"]
    pre = PAPER["m2_k4"]["prerouter"]
    step_ms = 1e3 / pre["decode_tok_s"]
    loads = pre["mib_per_step"] / pre["mib_per_load"]
    device_ms = PAPER["disk_share_max"] * step_ms / (loads * pre["cold_fraction"])
    latency = sc.hardware.ssd_latency_ms
    bandwidth = pre["mib_per_load"] * MIB / ((device_ms - latency) / 1e3) / 1e9
    mem = budget(sc)  # prerouter, K=4
    lru = (PAPER["peak_active_gib"] * GIB - mem.resident - mem.heads - mem.slots
           - mem.slot_views)
    # Both arms' cold fractions say the M2's page cache served no LRU miss, and the prerouter's
    # extra residency came out of the page cache without paging the engine: the page cache sat
    # at the kernel's floor beside the prerouter engine's peak. What is left is the OS's.
    reserve = (mem.ram - mem.engine - mem.page_cache_floor) / GIB
    return {
        "bundle_mib": bundle_mib,
        "demand_pieces": round(bundle_mib / PAPER["m2_k4"]["on-demand"]["mib_per_load"]),
        "device_ms_per_cold_load": device_ms,
        "ssd_bandwidth_gbps": bandwidth,
        "cold_overhead_ms": cold - device_ms,
        "lru_bytes": lru,
        "slots_bytes": mem.slots, "slot_views_bytes": mem.slot_views,
        "slots_text": f"{m.layers} layers x ({sc.k} + {sc.headroom}) x {bundle_mib:.4f} MiB",
        "views_text": f"{m.consumer_count} consumer layers x {sc.k} x {bundle_mib:.4f} MiB",
        "build_ms_per_layer": PAPER["graph_build_ms_per_step"] / m.layers,
        "os_reserve_gib": int(reserve * 100) / 100,  # down, so the prerouter arm never pages
        "engine_gib": mem.engine / GIB, "page_cache_floor_gib": mem.page_cache_floor / GIB,
        "committed": {
            "os_reserve_gib": sc.hardware.os_reserve_gib,
            "demand_pieces": sc.demand_pieces,
            "ssd_bandwidth_gbps": sc.hardware.ssd_bandwidth_gbps,
            "cold_overhead_ms": sc.hardware.cold_overhead_ms,
            "lru_bytes": sc.lru_bytes,
            "build_ms_per_layer": m.build_ms_per_layer,
            "load_overhead_ms": sc.hardware.load_overhead_ms,
        },
    }


def k_scaling() -> dict[int, float]:
    """Share of a layer's picks going to its 13 most popular experts, per K (synthetic law)."""
    from sim.routing_synth import SynthRouting, target_load

    sc = load_scenario("paper-m2-16gb")
    per_layer = round(sc.lru_bytes / sc.model.bundle_bytes / sc.model.layers)
    out = {}
    for k in (2, 4, 8):
        load = target_load(SynthRouting(layers=1, experts=sc.model.experts, k=k, skew=sc.skew,
                                        reuse=sc.overlap))[0]
        out[k] = float(sum(sorted(load, reverse=True)[:per_layer]))
    return out


def bisect(f, lo: float, hi: float, target: float, increasing: bool, iters: int = 9) -> float:
    for _ in range(iters):
        mid = (lo + hi) / 2
        above = f(mid) >= target
        if above == increasing:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def calibrate() -> dict[str, Any]:
    """One value from one on-demand K=4 component figure (section 2 of the report)."""
    base = [ARMS["on-demand"], "k=4", "seed=0"]
    target_mib = PAPER["m2_k4"]["on-demand"]["mib_per_step"]

    def mib(skew: float) -> float:
        return run_scenario(load_scenario("paper-m2-16gb", [*base, f"skew={skew}"])
                            ).metrics["mib_per_step"]

    skew = bisect(mib, 1.0, 3.0, target_mib, increasing=False)
    # The OS reserve is not fitted: it is derived in section 1 (no tok/s, no blocked time).
    sc = load_scenario("paper-m2-16gb", base)
    mem = budget(sc)
    cold = run_scenario(load_scenario("paper-m2-16gb", [*base, f"skew={skew:.3f}"])
                        ).metrics["cold_fraction"]
    return {"skew": skew, "skew_committed": load_scenario("paper-m2-16gb").skew,
            "os_reserve_gib": sc.hardware.os_reserve_gib, "cold_fraction_predicted": cold,
            "page_cache_gib_at_calibration": mem.page_cache / GIB}


def predict() -> dict[str, Any]:
    table: dict[str, Any] = {}
    for machine, name, ks in (("m2-16gb", "paper-m2-16gb", (2, 4, 8)),
                              ("m4pro-24gb", "paper-m4pro-24gb", (2, 4, 8))):
        for k in ks:
            for arm, lead in ARMS.items():
                table[f"{machine}/k{k}/{arm}"] = run(name, [f"k={k}", lead])
    whatif = {
        "m2 K=4 prerouter, 2 background readers (this project's engine)":
            ("paper-m2-16gb", [ARMS["prerouter"], "readers=2"]),
        "m2 K=4 on-demand, 2 background readers":
            ("paper-m2-16gb", [ARMS["on-demand"], "readers=2"]),
        "m2 K=8 on-demand, bundle LRU doubled (1.61 GB)":
            ("paper-m2-16gb", [ARMS["on-demand"], "k=8", "lru_bytes=1606000000"]),
        "m2 K=8 prerouter, bundle LRU doubled (1.61 GB)":
            ("paper-m2-16gb", [ARMS["prerouter"], "k=8", "lru_bytes=1606000000"]),
        "m4pro K=4 prerouter, the M2's load-cost fit (1.17 + 0.83 ms)":
            ("paper-m4pro-24gb", [ARMS["prerouter"], "load_overhead_ms=1.17",
                                  "cold_overhead_ms=0.83"]),
        "m4pro K=4 on-demand, the M2's load-cost fit (1.17 + 0.83 ms)":
            ("paper-m4pro-24gb", [ARMS["on-demand"], "load_overhead_ms=1.17",
                                  "cold_overhead_ms=0.83"]),
    }
    for lru, sets in LRU_8B.items():
        for arm, lead in ARMS.items():
            row = run("paper-m4pro-24gb-8b", [lead, *sets])
            row["engine_gib"] = budget(load_scenario("paper-m4pro-24gb-8b",
                                                     [lead, *sets])).engine / GIB
            table[f"m4pro-24gb/8b/{lru}/{arm}"] = row
    sc = load_scenario("paper-m4pro-24gb", ["prefill_tokens=3100", "decode_steps=20"])
    table["m4pro_prefill_cold"] = run_scenario(sc).metrics["prefill_tok_s"]
    table["whatif"] = {label: {"scenario": name, "set": sets, **run(name, sets, seeds=(0,))}
                       for label, (name, sets) in whatif.items()}
    table["reserve"] = {f"{gib}/{arm}": run("paper-m2-16gb", [lead, f"os_reserve_gib={gib}"],
                                            seeds=(0,))
                        for gib in RESERVES_GIB for arm, lead in ARMS.items()}
    return table


def _f(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _rng(v: dict[str, Any]) -> str:
    lo, hi = v["decode_tok_s_range"]
    return f"{lo:.2f}-{hi:.2f}"


def _free(v: dict[str, Any]) -> float:
    return 1e3 / v["decode_tok_s"] - v["blocked_ms_per_step"]


def _err(pred: float, paper: float) -> str:
    return f"{(pred - paper) / paper * 100:+.0f}%"


def write_8b(p: dict[str, Any]) -> list[str]:
    """Table 1's second tier: edge0-8b on the M4 Pro, the 35B's profile and routing."""
    t = PAPER["m4pro_8b"]
    rows = {lru: (p[f"m4pro-24gb/8b/{lru}/on-demand"], p[f"m4pro-24gb/8b/{lru}/prerouter"])
            for lru in LRU_8B}
    (o64, q64), (o1k, q1k) = rows["lru64"], rows["lru1024"]
    lines = [
        "## Mac mini M4 Pro 24 GB, edge0-8b K=8 (paper Table 1, second tier)",
        "",
        "`scenarios/paper-m4pro-24gb-8b.toml`: the same machine profile and engine as the 35B",
        "rows, the 8B's model profile (`scenarios/models/edge0-8b.toml`), its shared LRU of 64",
        "bundles, and the 35B's routing statistics (none are published for the 8B). Nothing",
        "here was fitted to an 8B figure.",
        "",
        "| shared LRU | paper prerouter tok/s | predicted | prerouter disabled, predicted |"
        " gain | blocked ms/step off -> on | loads/step off -> on | engine GiB (paper peak) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, paper, (o, q), peak in (
            ("64 bundles", t["prerouter"], (o64, q64), f"{t['peak_active_gib']}"),
            ("1,024 bundles", t["prerouter_lru1024"], (o1k, q1k),
             f"{t['peak_active_gib']} + ~{t['lru1024_extra_gib']}")):
        lines.append(
            f"| {label} | {paper} | {_f(q['decode_tok_s'])} ({_err(q['decode_tok_s'], paper)}) "
            f"| {_f(o['decode_tok_s'])} | {(q['decode_tok_s'] / o['decode_tok_s'] - 1) * 100:+.0f}%"
            f" | {_f(o['blocked_ms_per_step'], 1)} -> {_f(q['blocked_ms_per_step'], 1)} | "
            f"{_f(o['loads_per_step'], 0)} -> {_f(q['loads_per_step'], 0)} | "
            f"{_f(q['engine_gib'])} ({peak}) |")
    gain_paper = t["prerouter_lru1024"] / t["prerouter"] - 1
    gain_sim = q1k["decode_tok_s"] / q64["decode_tok_s"] - 1
    lines += [
        "",
        f"The larger LRU: paper {gain_paper * 100:+.0f}%, predicted {gain_sim * 100:+.0f}%.",
        f"It costs {q1k['engine_gib'] - q64['engine_gib']:.2f} GiB in the model, ~"
        f"{t['lru1024_extra_gib']} GiB in the paper",
        "(the digest's bundle size for this tier is approximate: scenarios/models/edge0-8b.toml).",
        "Every page-cache miss is a warm read here (the 4.5 GB",
        "model fits the M4 Pro's page cache), so the 8B rows measure the machine's warm",
        "per-load cost and the graph build (24 layers x 1.1 ms, the 35B's per-layer figure),",
        "not its SSD. The prerouter-disabled column is a prediction of a figure the digest",
        "does not give.",
    ]
    return lines


def write_readme(result: dict[str, Any]) -> str:
    d, c, p = result["derived"], result["calibrated"], result["predictions"]
    pm = PAPER["m2_k4"]
    lines = [
        "# The edge0 paper, predicted from its component figures",
        "",
        "Generated by `uv run python reports/paper/predict_paper.py` "
        f"({result['generated_at']}, {result['wall_s']:.0f} s); numbers also in `paper.json`.",
        "Every prediction is `ssdmoe sim run` on the committed scenarios, e.g.",
        "",
        "    uv run ssdmoe sim run paper-m2-16gb --set k=4 --set lead=none --json",
        "    uv run ssdmoe sim run paper-m2-16gb --set k=4 --set lead=token --json",
        "    uv run ssdmoe sim run paper-m4pro-24gb --set k=4 --set lead=token --json",
        "",
        "Tables give the median over routing seeds 0-2 (1,000 decode steps each); the CLI",
        "commands above print seed 0 (the `_seed0` fields of paper.json). Source of all paper",
        "figures: `../shared/reference/edge0-paper-digest.md`.",
        "",
        "## Headline: MacBook M2 16 GB, edge0-35b K=4 (paper Table 3)",
        "",
        "| | paper on-demand | predicted | paper prerouter | predicted |",
        "|---|---|---|---|---|",
    ]
    od, pr = p["m2-16gb/k4/on-demand"], p["m2-16gb/k4/prerouter"]
    for key, label, digits in (("decode_tok_s", "decode tok/s", 2),
                               ("blocked_ms_per_step", "blocked ms/step", 1),
                               ("mib_per_step", "MiB read/step", 1),
                               ("mib_per_load", "MiB/load", 2),
                               ("cold_fraction", "cold fraction (by load)", 2)):
        a, b = pm["on-demand"].get(key), pm["prerouter"].get(key)
        lines.append(f"| {label} | {_f(a, digits)} | {_f(od[key], digits)} ({_err(od[key], a)}) "
                     f"| {_f(b, digits)} | {_f(pr[key], digits)} ({_err(pr[key], b)}) |")
    gain_p = pm["prerouter"]["decode_tok_s"] / pm["on-demand"]["decode_tok_s"] - 1
    gain_s = pr["decode_tok_s"] / od["decode_tok_s"] - 1
    lines += [
        f"| loads/step | {_f(pm['on-demand']['mib_per_step'] / 0.27, 0)} (derived) | "
        f"{_f(od['loads_per_step'], 0)} | {_f(58.9 / 1.32, 0)} (derived) | "
        f"{_f(pr['loads_per_step'], 0)} |",
        "",
        f"Prerouter gain: paper {gain_p * 100:+.0f}%, predicted {gain_s * 100:+.0f}%. Spread over"
        f" routing seeds 0-2: on-demand {_rng(od)} tok/s, prerouter {_rng(pr)} tok/s.",
        "",
        "What was calibrated (section 2) and what is a prediction: on the on-demand arm, bytes/",
        "step (skew) and MiB/load (6 pieces) were fitted. The OS reserve is derived (section 1)",
        "from the digest's M2 memory evidence: both arms' cold fractions say the page cache",
        "served no LRU miss, and the prerouter's residency came out of the page cache without",
        "paging. No speed or blocked time enters it, so every tok/s and blocked figure here is a",
        "prediction; the cold fractions were used qualitatively and are not an independent",
        "check. Every prerouter figure, every K=2/K=8 figure and the M4 Pro are predictions. How",
        "much the reserve moves the M2 arms is shown under \"How the M2's OS reserve moves",
        "them\"; at the M4 Pro's 5.8 GiB bound (this report before 2026-12-02) the prerouter",
        f"arm was {_err(p['reserve']['5.8/prerouter']['decode_tok_s'], 6.4)}.",
        "",
        "## K=2 and K=8 (paper has them; withheld from the digest: pure predictions)",
        "",
        "| machine | K | on-demand tok/s | prerouter tok/s | gain | blocked ms/step on-demand"
        " -> prerouter | MiB/step | cold fraction | page cache GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for machine in ("m2-16gb", "m4pro-24gb"):
        for k in (2, 4, 8):
            o, q = p[f"{machine}/k{k}/on-demand"], p[f"{machine}/k{k}/prerouter"]
            gain = q["decode_tok_s"] / o["decode_tok_s"] - 1
            lines.append(
                f"| {machine} | {k} | {_f(o['decode_tok_s'])} | {_f(q['decode_tok_s'])} | "
                f"{gain * 100:+.0f}% | {_f(o['blocked_ms_per_step'], 1)} -> "
                f"{_f(q['blocked_ms_per_step'], 1)} | {_f(o['mib_per_step'], 1)} / "
                f"{_f(q['mib_per_step'], 1)} | {_f(o['cold_fraction'])} / "
                f"{_f(q['cold_fraction'])} | {_f(o['page_cache_gib'])} / "
                f"{_f(q['page_cache_gib'])} |")
    lines += [
        "",
        "How K is scaled (fixed before looking at any K=2/8 result): the same per-expert",
        "popularity (Zipf exponent) and the same 25% adjacent reuse, the same bundle LRU bytes,",
        "staged slots growing with K. The generator caps how often one expert can be picked",
        "(at most about half the tokens with 25% reuse), so a larger K pushes picks into the tail:",
        "the 13 most popular experts of a layer (the LRU's share per layer, 517 bundles / 40",
        "layers) get " + ", ".join(f"{v * 100:.0f}% of picks at K={k}"
                                   for k, v in result["k_scaling"].items()) + ".",
        "Bytes per step therefore grow much faster than K, and the K=8 prediction is very",
        "sensitive to the LRU size (see the doubled-LRU what-if). The digest's K=8 stager fill",
        "figure (62.5 ms/step, below) suggests the real K=8 routing is far more cacheable.",
        "Checked on routing captured at K=2/4/8 (`reports/routing-k`): with its K=4 parameters",
        "this law makes tiny-trained's LRU misses grow 1.19-1.75x from K=4 to K=8 where the",
        "model's grow 1.05-1.18x; top-K of latent router scores fitted at K=4 gets that growth",
        "within 0.07, and at this scale reads about half the chain's bundles at K=8. It cannot",
        "take the digest's K=4 pair (25% overlap at this miss rate), so the chain stays: the",
        "K=8 rows are likely pessimistic.",
        "",
        "On the M2 at K=8 the engine (K + K slots per layer) no longer fits beside the 12.58",
        "GiB the desktop session held at K=4. The page cache is already at its floor, so macOS",
        "gives way next: it compresses the other processes' idle memory (sim.memory_budget,",
        "os_floor_gib: down to the 5.8 GiB that macOS and the other processes still held under",
        "the M4 Pro's resident run, digest Table 1) before it pages the engine. The session",
        f"holds {p['m2-16gb/k8/on-demand']['os_held_gib']:.2f} GiB (on demand) and "
        f"{p['m2-16gb/k8/prerouter']['os_held_gib']:.2f} GiB (prerouter); "
        + ("the engine does not page." if not (p['m2-16gb/k8/on-demand']['swapped_fraction']
                                             or p['m2-16gb/k8/prerouter']['swapped_fraction'])
           else f"the engine pages {p['m2-16gb/k8/on-demand']['swapped_fraction'] * 100:.0f}% / "
                f"{p['m2-16gb/k8/prerouter']['swapped_fraction'] * 100:.0f}% of its memory."),
        "Before this mechanism the reserve was fixed, the engine paged 6% / 20%, and the",
        "prerouter lost at K=8 (0.94 against 1.13 tok/s on demand).",
    ]
    warn = [f"{key}: {w}" for key, v in p.items() if isinstance(v, dict) and "warnings" in v
            for w in v["warnings"]]
    if warn:
        lines += ["", "Memory notes (sim run prints them):", ""] + [f"- {w}" for w in warn]
    m4o, m4p = p["m4pro-24gb/k4/on-demand"], p["m4pro-24gb/k4/prerouter"]
    k8 = p["m2-16gb/k8/prerouter"]
    lines += [
        "",
        "## Mac mini M4 Pro 24 GB, K=4 (paper Table 1)",
        "",
        "| | paper | predicted |",
        "|---|---|---|",
        f"| prerouter off (on-demand) tok/s | 19.9 | {_f(m4o['decode_tok_s'])} "
        f"({_err(m4o['decode_tok_s'], 19.9)}) |",
        f"| prerouter tok/s | 20.4 | {_f(m4p['decode_tok_s'])} "
        f"({_err(m4p['decode_tok_s'], 20.4)}) |",
        "",
        "The digest's only per-load cost (1.17 ms warm + 1.33 ms x cold) was measured in the",
        "memory-pressured M2 16 GB campaign; the paper's 19.9-20.4 tok/s on 24 GB (49-50 ms/step",
        "against a 44 ms graph-build floor) leaves at most ~0.03 ms per on-demand load, so it",
        "cannot hold there. The M4 Pro profile instead takes a load's CPU from this project's",
        "machine, measured (an assumption that a warm pread costs about the same on macOS), and",
        "its page cache from the memory model (24 GiB - 5.8 GiB OS - the engine). The what-if",
        "below shows the M2 fit applied to it. What still misses: each cold load's fault work",
        "(0.45 ms measured here) and the 44 ms floor plus 33 heads' graph building leave the",
        "prediction below the paper's; no M4 Pro SSD or fault figure is published.",
        "",
        *write_8b(p),
        "",
        "## Component checks (not fitted)",
        "",
        f"- Prerouter bytes/step: paper 58.9 MiB vs predicted {_f(pr['mib_per_step'], 1)} "
        "(the model gives both arms the same routing statistics; the paper's prerouter moved",
        "  16% more bytes than on-demand, which a less cacheable predicted routing would explain).",
        f"- Prerouter MiB/load: paper 1.32 vs predicted {_f(pr['mib_per_load'])}: the 8 layers",
        "  without heads (0-6, 39) still read 6 pieces per bundle in the model; the paper's",
        "  figure implies they missed the LRU less often than the average layer.",
        f"- Prerouter cold fraction: paper 0.84 vs predicted {_f(pr['cold_fraction'])}.",
        f"- K=8 stager fill: paper 62.5 ms/step synchronous (machine not stated); predicted "
        f"blocked time of the M2 K=8 prerouter arm {_f(k8['blocked_ms_per_step'], 1)} ms/step.",
        f"- Time not blocked on loads (1000 / tok/s - blocked ms): paper 41.7 ms on demand and "
        f"54.4 ms with the prerouter; predicted {_f(_free(od), 1)} and {_f(_free(pr), 1)} "
        f"(graph build {_f(od['build_ms_per_step'], 1)} / {_f(pr['build_ms_per_step'], 1)} ms, "
        f"accelerator waits {_f(od['eval_ms_per_step'], 1)} / {_f(pr['eval_ms_per_step'], 1)} ms:"
        " on demand every layer syncs on its router, which the paper's figure suggests costs"
        " less than modelled).",
        "",
        "## What-ifs (seed 0)",
        "",
        "| what-if | tok/s | blocked ms/step | cold fraction |",
        "|---|---|---|---|",
    ]
    for label, v in p["whatif"].items():
        lines.append(f"| {label} | {_f(v['decode_tok_s'])} | {_f(v['blocked_ms_per_step'], 1)} "
                     f"| {_f(v['cold_fraction'])} |")
    lines += [
        "",
        "## How the M2's OS reserve moves them (K=4, seed 0)",
        "",
        "| OS reserve GiB | page cache GiB | on-demand tok/s | prerouter tok/s | blocked ms/step |"
        " cold fraction | engine paged out |",
        "|---|---|---|---|---|---|---|",
    ]
    for gib in RESERVES_GIB:
        o, q = p["reserve"][f"{gib}/on-demand"], p["reserve"][f"{gib}/prerouter"]
        mark = " (derived)" if gib == d["os_reserve_gib"] else ""
        lines.append(
            f"| {gib}{mark} | {_f(o['page_cache_gib'])} / {_f(q['page_cache_gib'])} | "
            f"{_f(o['decode_tok_s'])} ({_err(o['decode_tok_s'], 3.5)}) | "
            f"{_f(q['decode_tok_s'])} ({_err(q['decode_tok_s'], 6.4)}) | "
            f"{_f(o['blocked_ms_per_step'], 1)} / {_f(q['blocked_ms_per_step'], 1)} | "
            f"{_f(o['cold_fraction'])} / {_f(q['cold_fraction'])} | "
            f"{o['swapped_fraction'] * 100:.0f}% / {q['swapped_fraction'] * 100:.0f}% |")
    lines += [
        "",
        "Pairs are on-demand / prerouter; paper: 3.5 / 6.4 tok/s, 244 / 102 ms blocked, 0.17 /",
        "0.84 cold. Below ~11 GiB the page cache holds most of the LRU's misses (both arms too",
        "warm, the prerouter's gain too large). The derived figure sits at the edge where the",
        "page cache reaches its floor (by construction), so the floor (0.5 GiB, an assumption)",
        "moves it one for one; a larger reserve changes nothing, because macOS gives the excess",
        "back (compression, down to the 5.8 GiB floor) before the engine pages.",
        "",
        "Prefill is modelled (whole-layer reads overlapping compute) but not a target here: on",
        "the M4 Pro a cold 3,100-token prefill is predicted at "
        f"{_f(p['m4pro_prefill_cold'], 0)} tok/s against the paper's 113 (cold) / 140 (warm);",
        "its compute side uses the Apple spec TFLOPS at full efficiency, which MLX does not",
        "reach, so it is optimistic until calibrated.",
    ]
    lines += [
        "",
        "## 1. Derived from digest figures (closed form)",
        "",
        f"- Bundle: 453 MB per layer / 256 experts = {d['bundle_mib']:.4f} MiB.",
        f"- On-demand reads per bundle: 1.6875 MiB / 0.27 MiB per load = {d['demand_pieces']}"
        " (demand_pieces; prerouter loads are whole bundles). With readahead the first piece of",
        "  a page-cache miss is cold and brings the bundle in: 1 cold + 5 warm pieces = 17% cold,",
        "  exactly the digest's on-demand cold fraction when every LRU miss is a page-cache miss.",
        "- Per load: 1.17 ms on the thread doing it (warm part of the fit); a cold load adds "
        "1.33 ms,",
        f"  split into device time {d['device_ms_per_cold_load']:.3f} ms (from \"disk reads at "
        "most 12% of a step\": 0.12 x 156.25 ms / (44.6 loads x 0.84 cold)) and",
        f"  {d['cold_overhead_ms']:.3f} ms of CPU (page faults). Device bandwidth: 1.32 MiB in "
        f"(device time - 0.05 ms latency) = {d['ssd_bandwidth_gbps']:.2f} GB/s. This split uses"
        " the",
        "  prerouter arm's step time, but it cannot move synchronous-fill predictions (the sum is",
        "  the fit); it only matters for the background-reader what-ifs.",
        "- Bundle LRU: peak active 2.9 GiB - resident 1.38 GB - 33 heads x 4 MiB - staged slot "
        f"tables ({d['slots_text']} = {d['slots_bytes'] / 1e6:.0f} MB) - duplicate views "
        f"({d['views_text']} = {d['slot_views_bytes'] / 1e6:.0f} MB) = "
        f"{d['lru_bytes'] / 1e6:.0f} MB.",
        f"- Graph build: 44 ms / 40 layers = {d['build_ms_per_layer']:.2f} ms per layer.",
        "- M2 OS reserve (macOS and every other process): both arms' cold fractions say the",
        "  page cache served no LRU miss (on demand 17% = the one cold piece of each 6-piece",
        "  miss; prerouter 84% = about every whole-bundle prefetch cold, the rest its 8 layers'",
        "  pieces), and \"unreclaimable MLX allocation rises ... and page cache shrinks",
        "  correspondingly\": the prerouter's residency came out of the page cache, not by paging",
        "  the engine. The smallest page cache that allows is the kernel's floor, beside the",
        f"  prerouter engine's peak: 16 GiB - {d['engine_gib']:.2f} GiB (2.9 GiB peak + KV) - "
        f"{d['page_cache_floor_gib']:.1f} GiB floor = {d['os_reserve_gib']:.2f} GiB, above the",
        "  digest's 5.8 GiB bound from the M4 Pro. The M4 Pro keeps that bound (\"on 24 GB the",
        "  page cache already keeps hot experts\").",
        "- What the OS gives way to under pressure (os_floor_gib, both Macs): 5.8 GiB, what",
        "  macOS and the other processes still held while resident mlx-lm paged on the M4 Pro",
        "  (digest Table 1). The M2 session's 12.58 GiB is what it held unpressed; past the",
        "  page cache's floor it shrinks toward 5.8 GiB (the memory compressor) before the",
        "  engine's memory pages out.",
        f"- Committed values used by the predictions: {json.dumps(d['committed'])}.",
        "",
        "## 2. Calibrated on the on-demand K=4 arm (one figure each)",
        "",
        "- Routing skew (Zipf exponent of per-layer expert popularity, synthetic routing with",
        f"  25% adjacent overlap): {c['skew']:.3f} gives the digest's 50.9 MiB/step on demand"
        f" (committed: {c['skew_committed']}).",
        f"- OS reserve (not fitted): {c['os_reserve_gib']:.2f} GiB, derived in section 1; the "
        f"expert files get ~{c['page_cache_gib_at_calibration']:.2f} GiB",
        "  of page cache on demand, and the on-demand cold fraction comes out at "
        f"{c['cold_fraction_predicted']:.3f} (digest 0.17).",
        "  RAM is a mechanism (sim.memory_budget, sim.swap): what the OS and the engine leave goes "
        "to",
        "  the page cache; past its floor the engine itself pages.",
        "",
        "## Assumptions (each also commented in the TOML files)",
        "",
        "- Synthetic routing: per-layer Zipf popularity + 25% adjacent reuse; predicted sets",
        "  (executed under the prerouter) have the same statistics as routed ones.",
        "- The paper's engine: every load synchronous on the main thread (the digest: the",
        "  stager's fill runs synchronously on the main thread); staged prefetches for all 32",
        "  consumer layers issued at the step boundary; non-consumer layers read on demand.",
        "- Accelerator work overlaps graph building (async eval); each on-demand layer syncs on",
        "  its router. Memory bandwidth / TFLOPS are Apple spec figures (not in the digest); they",
        "  matter little because compute hides under the 44 ms build.",
        "- Head graph build 0.14 ms per head; KV 20 KiB/token; SSD latency 0.05 ms (assumptions).",
        "",
        "## What this says",
        "",
        "The M2 arms are dominated by the per-load cost: on demand, ~30 bundles per step each",
        "read as ~6 loads of 1.17 ms; the prerouter reads whole bundles (1 load each) and takes",
        "the router sync off 32 layers. From components alone the model lands at "
        f"{_err(od['decode_tok_s'], 3.5)} of the paper's tok/s on demand and "
        f"{_err(pr['decode_tok_s'], 6.4)} with the prerouter (target: within 15%); blocked "
        f"{_err(od['blocked_ms_per_step'], 244.0)} and {_err(pr['blocked_ms_per_step'], 101.9)}.",
        "That rests on the derived OS reserve: the M2's page cache was small, and the table",
        "above shows what a roomier one would predict. Where it still misses: the prerouter's",
        "loads are too many and too warm (the paper's 45 loads at 84% cold against the model's",
        f"{_f(pr['loads_per_step'], 0)} at {_f(pr['cold_fraction'])}: its 8 layers without heads",
        "read 6 pieces per LRU miss as often as the average layer, while the paper's MiB/load",
        "says they missed less), its bytes/step (predicted sets get the routing's statistics;",
        "the paper's moved 16% more), and the M4 Pro, where the only per-load cost in the",
        "digest (from the M2) cannot hold: the paper's 24 GB speeds leave at most ~0.03 ms per",
        "load. Those are",
        "the figures to measure (`ssdmoe calibrate`, captured traces), not to tune. The",
        "background-reader what-if is the design of this project's engine (issue 4): on the M2",
        "it predicts the prerouter would gain again as much by moving the fill off the main",
        "thread.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    t0 = time.perf_counter()
    result: dict[str, Any] = {"generated_at": time.strftime("%Y-%m-%d %H:%M"),
                              "paper": PAPER}
    result["derived"] = derive()
    result["k_scaling"] = k_scaling()
    print("derived:", json.dumps(result["derived"], indent=1), flush=True)
    result["calibrated"] = calibrate()
    print("calibrated:", json.dumps(result["calibrated"], indent=1), flush=True)
    result["predictions"] = predict()
    result["wall_s"] = time.perf_counter() - t0
    result["command"] = "uv run python reports/paper/predict_paper.py"
    (OUT / "paper.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (OUT / "README.md").write_text(write_readme(result))
    print(f"wrote {OUT / 'README.md'} and paper.json in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
