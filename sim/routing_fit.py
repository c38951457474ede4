"""Routing statistics fitted to captured traces: what the synthetic generator (sim.routing_synth)
needs to stand in for a model's real routing, and how they scale with K.

Per trace (one K), over its decode routing (the model's own routers, `router_experts`):
  reuse   the mean adjacent-token overlap |S_t & S_t-1| / K over consecutive decode tokens of
          the same request: the generator's `reuse` has exactly that expectation
  skew    the Zipf exponent whose generated routing has the trace's load entropy (the
          normalised entropy of each layer's expert loads, averaged over layers), found by
          bisection on routing generated with the trace's own layers, experts, K and length, so
          the finite-sample bias of the entropy is the same on both sides
Across K (traces of one model routed at several K, `ssdmoe capture --top-k`), least squares:
  reuse(K) = reuse_at_k0 + reuse_per_expert_share x K / experts
  skew(K)  = skew_at_k0 + skew_per_k x K
`check` replays a trace's decode steps and the fitted generator through one scenario and
compares bytes per step and the page-cache and app-cache hit rates. No MLX."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from contract.errors import BadInput
from sim.routing_synth import SynthRouting, generate_sets, routing_sets
from traces.reader import Trace

MIN_TOKENS = 32  # decode tokens (with a predecessor) a fit needs


@dataclass
class RoutingFit:
    source: str
    layers: int
    experts: int
    k: int
    tokens: int  # adjacent decode-token pairs the overlap was measured on
    reuse: float
    load_entropy: float
    skew: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _entropy(router: np.ndarray, experts: int) -> float:
    """Mean over layers of the normalised entropy of the layer's expert loads."""
    out = []
    for layer in range(router.shape[1]):
        ids = router[:, layer].ravel()
        counts = np.bincount(ids[ids >= 0], minlength=experts).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        out.append(float(-(p * np.log(p)).sum() / np.log(experts)))
    return float(np.mean(out))


def _pairs(router: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Overlap fraction of each adjacent pair of decode tokens within a request."""
    a, b = router[1:], router[:-1]
    same = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1) / router.shape[-1]
    return same[~boundaries[1:]]  # [pairs, layers]


def fit_trace(trace: Trace) -> RoutingFit:
    """Reuse and skew of one trace's decode routing (BadInput when it is too short)."""
    sets = routing_sets(trace)
    router = sets.router
    where = str(trace.path)
    if router.size == 0 or (router < 0).all():
        raise BadInput(f"{where}: no decode routing to fit routing statistics on")
    steps = trace.steps.filter(trace.steps["phase"] == "decode")
    request = dict(zip(steps["step"].to_list(), steps["request"].to_list(), strict=True))
    req = np.asarray([request.get(int(s), -1) for s in sets.step])
    boundaries = np.concatenate(([True], req[1:] != req[:-1]))
    pairs = _pairs(router, boundaries)
    if len(pairs) < MIN_TOKENS:
        raise BadInput(f"{where}: {len(pairs)} adjacent decode tokens: too short to fit routing "
                       f"statistics (need at least {MIN_TOKENS})")
    layers, k = router.shape[1], router.shape[2]
    experts = int((trace.run.get("model") or {}).get("experts") or int(router.max()) + 1)
    entropy = _entropy(router, experts)
    reuse = float(pairs.mean())
    skew = fit_skew(layers, experts, k, len(router), reuse, entropy)
    return RoutingFit(where, layers, experts, k, len(pairs), reuse, entropy, skew)


def fit_skew(layers: int, experts: int, k: int, steps: int, reuse: float,
             entropy: float) -> float:
    """The Zipf exponent whose generated routing (same shape and length) has `entropy`."""
    def generated(skew: float) -> float:
        params = SynthRouting(layers=layers, experts=experts, k=k, steps=steps, skew=skew,
                              reuse=min(reuse, 0.95), seed=0)
        return _entropy(generate_sets(params).router, experts)

    lo, hi = 0.0, 4.0
    if generated(lo) <= entropy:
        return 0.0  # as even as uniform routing can look at this length
    for _ in range(30):
        mid = (lo + hi) / 2
        if generated(mid) > entropy:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def k_scaling(fits: list[RoutingFit]) -> dict[str, float]:
    """Least-squares lines of reuse over K / experts and of skew over K (two K at least)."""
    ks = sorted({f.k for f in fits})
    if len(ks) < 2:
        raise BadInput("routing fit across K: needs traces routed at two K at least "
                       f"(got K={', '.join(map(str, ks))})")
    share = np.asarray([f.k / f.experts for f in fits])
    kk = np.asarray([float(f.k) for f in fits])
    reuse_b, reuse_a = np.polyfit(share, [f.reuse for f in fits], 1)
    skew_b, skew_a = np.polyfit(kk, [f.skew for f in fits], 1)
    return {"reuse_at_k0": float(reuse_a), "reuse_per_expert_share": float(reuse_b),
            "skew_at_k0": float(skew_a), "skew_per_k": float(skew_b)}


def scaled(scaling: dict[str, float], k: int, experts: int) -> tuple[float, float]:
    """(reuse, skew) the K-scaling fit gives at `k` (as sim.routing_input applies it)."""
    reuse = scaling["reuse_at_k0"] + scaling["reuse_per_expert_share"] * k / experts
    skew = scaling["skew_at_k0"] + scaling["skew_per_k"] * k
    return float(min(max(reuse, 0.0), 0.95)), float(max(skew, 0.0))


def constant(fit: RoutingFit) -> dict[str, float]:
    """The scaling of a single K: its reuse and skew at every K."""
    return {"reuse_at_k0": fit.reuse, "reuse_per_expert_share": 0.0,
            "skew_at_k0": fit.skew, "skew_per_k": 0.0}


def profile_values(fits: list[RoutingFit]) -> dict[str, tuple[float, str]]:
    """Model-profile keys (value, how) of the fits: the K-scaling lines, or one K's constants."""
    per = "; ".join(f"K={f.k}: reuse {f.reuse:.3f}, entropy {f.load_entropy:.3f} -> skew "
                    f"{f.skew:.3f} ({f.tokens} token pairs, {f.source})" for f in fits)
    if len({f.k for f in fits}) >= 2:
        sc, how = k_scaling(fits), f"least squares over K ({per})"
    else:
        sc, how = constant(fits[0]), f"one K only, constant in K ({per})"
    return {"routing_reuse_at_k0": (round(sc["reuse_at_k0"], 4), how),
            "routing_reuse_per_expert_share": (round(sc["reuse_per_expert_share"], 4),
                                               "reuse(K) slope over K / experts"),
            "routing_skew_at_k0": (round(sc["skew_at_k0"], 4), "skew(K) intercept"),
            "routing_skew_per_k": (round(sc["skew_per_k"], 4), "skew(K) slope over K")}


def _decode_figures(result) -> dict[str, float | None]:
    steps = result.trace.steps.filter(result.trace.steps["phase"] == "decode")
    hits, misses = int(steps["cache_hits"].sum()), int(steps["cache_misses"].sum())
    cold = result.metrics["cold_fraction"]
    return {"mib_per_step": result.metrics["mib_per_step"],
            "loads_per_step": result.metrics["loads_per_step"],
            "page_cache_hit_rate": None if cold is None else 1.0 - cold,
            "app_cache_hit_rate": hits / (hits + misses) if hits + misses else None}


def check(trace: Trace, reuse: float, skew: float, scenario: str,
          page_cache_fraction: float = 0.25,
          sets: list[str] | None = None) -> dict[str, dict[str, float | None]]:
    """Replay the trace's routing and the generator's (reuse, skew) through one scenario, its
    page cache `page_cache_fraction` of the expert bytes: decode bytes and loads per step,
    page-cache hit rate (by load) and app-cache hit rate, side by side."""
    from sim.memory import budget
    from sim.profiles import apply_overrides, load_scenario
    from sim.replay import run_scenario
    from sim.routing_input import from_trace
    from sim.scenario import GIB

    steps = int((trace.steps["phase"] == "decode").sum())
    k = int((trace.run.get("engine") or {}).get("k") or 0)
    base = [*(sets or []), f"decode_steps={steps}", *([f"k={k}"] if k else [])]
    sc = load_scenario(scenario, base)
    mem = budget(sc)
    reserve = (mem.ram - mem.engine - page_cache_fraction * sc.model.expert_bytes) / GIB
    sc = apply_overrides(sc, [f"os_reserve_gib={reserve:.9f}"])
    routing = from_trace(trace, sc)
    # decode steps only, as the generator's: a prefill's whole-layer reads would warm the page
    # cache for the trace alone
    routing.plan = [p for p in routing.plan if p[0] == "decode"]
    replayed = _decode_figures(run_scenario(sc, routing=routing))
    synth = _decode_figures(run_scenario(apply_overrides(
        sc, [f"overlap={reuse:.4f}", f"skew={skew:.4f}"])))
    return {name: {"trace": replayed[name], "generated": synth[name]} for name in replayed}
