"""How synthetic routing carries across K, checked on routing captured at K=2, 4 and 8.

The paper's scenarios predict K=2 and K=8 from routing statistics known at K=4 only (the
digest's 25% adjacent overlap, a popularity fitted to its bytes per step). Whether the
generator's law for K holds can be measured on this project's own model: tiny-trained routed
at K=2, 4 and 8 (`ssdmoe capture --top-k`, same prompts and seed). For each set of traces:

  measured         each K's own routing (the model's routers)
  chain, K=4 fit   sim.routing_synth fitted at K=4 (sim.routing_fit.fit_trace: overlap, Zipf
                   popularity, multi-token recall), run at every K with those parameters: what
                   the paper scenarios do away from K=4
  latent, K=4 fit  top-K of latent router scores: score = spread x b_e + a token part (an AR(1)
                   across tokens, plus a slower AR(1) share), b_e a fixed per-expert bias; the
                   routed set at any K is the top K of the same scores, as a router's is. Fitted
                   at K=4 to the same statistics (overlap, load entropy, novelty)
  chain, own fit   fitted at each K (not held out: the chain's floor at that K)

Figures: adjacent overlap, load entropy, and the share of a layer's picks missing a per-layer
LRU of 1/8, 1/4 and 1/2 of the experts (what a bundle cache of that size reads per token).
Then the paper's scale (256 experts, the LRU's 13 bundles a layer): where each law puts the
K=2 and K=8 misses, and whether the latent law can reach the digest's K=4 pair at all.

Usage: uv run python reports/routing-k/run.py   (~2 min; writes results.json, prints tables)
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from contract.errors import BadInput  # noqa: E402
from sim.routing_fit import adjacent_overlaps, fit_trace, load_entropy, novelty  # noqa: E402
from sim.routing_synth import SynthRouting, generate_sets, routing_sets  # noqa: E402
from traces.reader import read_trace  # noqa: E402

KS = (2, 4, 8)
CACHE_SHARES = (0.125, 0.25, 0.5)  # per-layer LRU, share of a layer's experts
SEEDS = (0, 1, 2)  # generated routings averaged per figure
TRACE_SETS = {
    "validate (seed 0, 4 prompts x 96 tokens)": {
        2: "reports/validation/traces/on-demand-pc25-unthrottled-k2",
        4: "reports/validation/traces/on-demand-pc25-unthrottled",
        8: "reports/validation/traces/on-demand-pc25-unthrottled-k8"},
    "routing-k (seed 1, 8 prompts x 128 tokens)": {
        k: f"reports/routing-k/traces/k{k}" for k in KS},
}
# the paper's M2 scenario (scenarios/paper-m2-16gb.toml): 256 experts, skew, overlap; its
# bundle LRU holds 803 MB / 1.6875 MiB bundles / 40 layers ~ 13 bundles a layer
PAPER = {"experts": 256, "skew": 2.35, "overlap": 0.25, "per_layer_lru": 13}


def lru_miss(router: np.ndarray, capacity: int) -> float:
    """Share of picks missing a per-layer LRU of `capacity` experts (carried across requests,
    as the engine's cache is)."""
    misses = picks = 0
    for layer in range(router.shape[1]):
        cache: OrderedDict[int, None] = OrderedDict()
        for ids in router[:, layer]:
            for e in ids.tolist():
                picks += 1
                if e in cache:
                    cache.move_to_end(e)
                    continue
                misses += 1
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return misses / picks


def figures(router: np.ndarray, experts: int, caps: tuple[int, ...]) -> dict:
    first = np.zeros(len(router), dtype=bool)
    first[0] = True
    return {"overlap": float(adjacent_overlaps(router, first).mean()),
            "entropy": load_entropy(router, experts),
            "novelty": novelty(router),
            "lru_miss": [lru_miss(router, c) for c in caps]}


def mean_figures(routers: list[np.ndarray], experts: int, caps: tuple[int, ...]) -> dict:
    each = [figures(r, experts, caps) for r in routers]
    return {key: (np.mean([f[key] for f in each], axis=0).tolist()
                  if isinstance(each[0][key], list) else float(np.mean([f[key] for f in each])))
            for key in each[0]}


def latent_sets(layers: int, experts: int, k: int, steps: int, spread: float, memory: float,
                slow: float, slow_memory: float, seed: int) -> np.ndarray:
    """[steps, layers, k]: top-K of spread x bias + sqrt(1 - slow) x fast + sqrt(slow) x slow
    parts, each part a unit-variance AR(1) across tokens (coefficients memory, slow_memory)."""
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal((layers, experts)) * spread
    fast = rng.standard_normal((layers, experts))
    slow_part = rng.standard_normal((layers, experts))
    out = np.empty((steps, layers, k), dtype=np.int64)
    for t in range(steps):
        score = bias + np.sqrt(1 - slow) * fast + np.sqrt(slow) * slow_part
        out[t] = np.argpartition(-score, k - 1, axis=1)[:, :k]
        fast = memory * fast + np.sqrt(1 - memory ** 2) * rng.standard_normal(fast.shape)
        slow_part = slow_memory * slow_part + np.sqrt(1 - slow_memory ** 2) * \
            rng.standard_normal(slow_part.shape)
    return out


def fit_latent(target: dict, layers: int, experts: int, k: int, steps: int) -> tuple:
    """(spread, memory, slow, slow_memory) matching the target's overlap, entropy and novelty:
    a seeded random search, then a local one (the figures are Monte Carlo: no gradients)."""
    def loss(p: tuple) -> float:
        f = mean_figures([latent_sets(layers, experts, k, steps, *p, seed=s)
                          for s in SEEDS[:2]], experts, ())
        return (10 * (f["overlap"] - target["overlap"]) ** 2
                + 10 * (f["entropy"] - target["entropy"]) ** 2
                + float(np.mean((np.array(f["novelty"]) - target["novelty"]) ** 2)))

    rng = np.random.default_rng(0)
    tries = [(rng.uniform(0, 1.0), rng.uniform(0, 0.6), rng.uniform(0, 0.8),
              rng.uniform(0.8, 0.995)) for _ in range(120)]
    best = min(((loss(p), p) for p in tries), key=lambda x: x[0])
    for _ in range(60):
        p = np.clip(np.array(best[1]) + rng.normal(0, [0.03, 0.03, 0.04, 0.01]),
                    [0, 0, 0, 0.5], [3, 0.97, 1, 0.998])
        cand = (loss(tuple(p)), tuple(float(v) for v in p))
        if cand[0] < best[0]:
            best = cand
    return best[1]


def chain_sets(fit, k: int, steps: int, layers: int, experts: int, seed: int) -> np.ndarray:
    return generate_sets(SynthRouting(
        layers=layers, experts=experts, k=k, steps=steps, skew=fit.skew,
        reuse=min(fit.reuse, 0.95), recall=fit.recall, window=fit.window,
        seed=seed)).router.astype(np.int64)


def trace_set(name: str, paths: dict[int, str]) -> dict:
    traces = {k: read_trace(ROOT / p) for k, p in paths.items()}
    routers = {k: routing_sets(t).router.astype(np.int64) for k, t in traces.items()}
    fits = {k: fit_trace(t) for k, t in traces.items()}
    steps, layers, _ = routers[4].shape
    experts = fits[4].experts
    caps = tuple(max(1, round(s * experts)) for s in CACHE_SHARES)
    latent = fit_latent(figures(routers[4], experts, ()), layers, experts, 4, steps)
    rows = {}
    for k in KS:
        rows[k] = {
            "measured": figures(routers[k], experts, caps),
            "chain, K=4 fit": mean_figures([chain_sets(fits[4], k, steps, layers, experts, s)
                                            for s in SEEDS], experts, caps),
            "latent, K=4 fit": mean_figures([latent_sets(layers, experts, k, steps, *latent,
                                                         seed=10 + s) for s in SEEDS],
                                            experts, caps),
            "chain, own fit": mean_figures([chain_sets(fits[k], k, steps, layers, experts, s)
                                            for s in SEEDS], experts, caps),
        }
    return {"name": name, "traces": paths, "tokens": steps, "layers": layers,
            "experts": experts, "lru_experts": list(caps),
            "chain_fit_k4": fits[4].as_dict(),
            "latent_fit_k4": dict(zip(("spread", "memory", "slow", "slow_memory"), latent,
                                      strict=True)),
            "rows": rows}


def paper_scale() -> dict:
    """The paper's law (chain, scenario parameters) at K=2/4/8, and the latent law with its
    token part independent (memory 0, the least overlap it can give) at the spread whose K=4
    miss equals the chain's: the overlap it needs there, and its K=2/K=8 misses."""
    layers, steps, n, cap = 8, 400, PAPER["experts"], PAPER["per_layer_lru"]

    def chain(k: int) -> dict:
        return mean_figures([generate_sets(SynthRouting(
            layers=layers, experts=n, k=k, steps=steps, skew=PAPER["skew"],
            reuse=PAPER["overlap"], seed=s)).router.astype(np.int64) for s in SEEDS[:2]],
            n, (cap,))

    def latent(k: int, spread: float) -> dict:
        return mean_figures([latent_sets(layers, n, k, steps, spread, 0.0, 0.0, 0.9, seed=s)
                             for s in SEEDS[:2]], n, (cap,))

    chain_rows = {k: chain(k) for k in KS}
    # the least the chain can read at K=8: popularity far past the scenario's, every hot
    # expert at the generator's inclusion cap (sim.routing_synth.MAX_INCLUSION)
    floor = mean_figures([generate_sets(SynthRouting(
        layers=layers, experts=n, k=8, steps=steps, skew=8.0, reuse=PAPER["overlap"],
        seed=s)).router.astype(np.int64) for s in SEEDS[:2]], n, (cap,))
    target = chain_rows[4]["lru_miss"][0]
    lo, hi = 0.5, 4.0  # the miss falls as the spread grows
    for _ in range(10):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if latent(4, mid)["lru_miss"][0] > target else (lo, mid)
    spread = (lo + hi) / 2
    latent_rows = {k: latent(k, spread) for k in KS}
    return {"parameters": PAPER, "chain": chain_rows, "chain_k8_floor": floor,
            "latent_spread": spread, "latent": latent_rows}


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred / meas - 1):+.0f}%"


def print_tables(sets: list[dict], paper: dict) -> None:
    for s in sets:
        caps = "/".join(str(c) for c in s["lru_experts"])
        print(f"\n{s['name']}: {s['tokens']} tokens x {s['layers']} layers, "
              f"{s['experts']} experts; LRU of {caps} experts a layer")
        print("| K | routing | overlap | entropy | LRU miss | miss vs measured | "
              "miss / its own K=4 miss (measured) |")
        print("|---|---|---|---|---|---|---|")
        for k, rows in s["rows"].items():
            meas = rows["measured"]["lru_miss"]
            for name, f in rows.items():
                miss = "/".join(f"{v:.3f}" for v in f["lru_miss"])
                err = "-" if name == "measured" else " ".join(
                    _pct(p, m) for p, m in zip(f["lru_miss"], meas, strict=True))
                at4 = s["rows"][4][name]["lru_miss"]
                ratio = "/".join(f"{v / b:.2f}" for v, b in zip(f["lru_miss"], at4,
                                                               strict=True))
                print(f"| {k} | {name} | {f['overlap']:.3f} | {f['entropy']:.3f} | {miss} "
                      f"| {err} | {ratio} |")
    print(f"\npaper scale ({PAPER['experts']} experts, LRU {PAPER['per_layer_lru']} a layer)")
    print("| K | chain (scenario) overlap / miss / bundles a token a layer | "
          "latent (memory 0) overlap / miss / bundles |")
    print("|---|---|---|")
    for k in KS:
        c, lt = paper["chain"][k], paper["latent"][k]
        print(f"| {k} | {c['overlap']:.3f} / {c['lru_miss'][0]:.3f} / "
              f"{k * c['lru_miss'][0]:.2f} | {lt['overlap']:.3f} / {lt['lru_miss'][0]:.3f} / "
              f"{k * lt['lru_miss'][0]:.2f} |")
    print(f"latent spread {paper['latent_spread']:.2f} (K=4 miss equal to the chain's); "
          f"the chain's least K=8 miss at overlap {PAPER['overlap']}: "
          f"{paper['chain_k8_floor']['lru_miss'][0]:.3f}")


def main() -> None:
    try:
        sets = [trace_set(name, paths) for name, paths in TRACE_SETS.items()]
    except BadInput as err:  # a trace missing or unreadable: one line, naming it
        raise SystemExit(f"run.py: {err}") from None
    paper = paper_scale()
    print_tables(sets, paper)
    result = {"command": "uv run python reports/routing-k/run.py",
              "model": "models/tiny-trained-stream", "sets": sets, "paper_scale": paper}
    (HERE / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {HERE / 'results.json'}")


if __name__ == "__main__":
    main()
