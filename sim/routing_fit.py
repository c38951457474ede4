"""Routing statistics fitted to captured traces: what the synthetic generator (sim.routing_synth)
needs to stand in for a model's real routing, and how they scale with K.

Per trace (one K), over its decode routing (the model's own routers, `router_experts`):
  reuse   the mean adjacent-token overlap |S_t & S_t-1| / K over consecutive decode tokens of
          the same request: the generator's `reuse` has exactly that expectation
  skew    the Zipf exponent whose generated routing has the trace's load entropy (the
          normalised entropy of each layer's expert loads, averaged over layers), found by
          bisection on routing generated with the trace's own layers, experts, K and length, so
          the finite-sample bias of the entropy is the same on both sides
  recall, window  multi-token reuse: the pair (from the grid RECALLS x WINDOWS) whose
          generated routing, the skew refitted with it, has the trace's novelty closest (root
          mean square over NOVELTY_WINDOWS).
          Novelty at w = the share of a token's experts absent from the last w tokens' sets of
          its request: what a cache w tokens deep misses. A chain with adjacent reuse alone
          has too much of it at w >= 4 (measured on this project's traces: issue 12)
Across K (traces of one model routed at several K, `ssdmoe capture --top-k`): one entry per
captured K in the model profile; synthetic routing at another K interpolates linearly between
them (sim.routing_input.at_k). Measured on this project's fixture: reuse grows convexly with K
and skew and recall are not monotone in it, so no straight line through them fits every K.
`check` replays a trace's decode steps and the fitted generator (the mean of CHECK_SEEDS) through
one scenario and compares bytes per step and the page-cache and app-cache hit rates. No MLX."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from contract.errors import BadInput
from sim.bisection import decreasing_root
from sim.routing_synth import SynthRouting, generate_sets, routing_sets
from traces.reader import Trace

MIN_TOKENS = 32  # decode tokens (with a predecessor) a fit needs
NOVELTY_WINDOWS = (2, 4, 8, 16, 32)  # tokens back
RECALLS = (0.0, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9)
WINDOWS = (16, 32, 64, 128)
FIT_SEEDS = (1, 2)  # generated routings a fit compares with (seed 0 is the skew bisection's)
CHECK_SEEDS = (0, 1, 2)  # generated routings `check` averages (one seed's hit rates are noisy)


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
    recall: float = 0.0
    window: int = 16
    novelty: list[float] | None = None  # measured, at NOVELTY_WINDOWS
    novelty_generated: list[float] | None = None  # the fitted generator's, same windows

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Routing:
    """One trace's decode routing and what the fit measures on it (once per trace)."""
    source: str
    router: np.ndarray  # [tokens, layers, K]
    experts: int
    pairs: int  # adjacent decode-token pairs within a request
    reuse: float
    entropy: float
    novelty: list[float]


def novelty(router: np.ndarray, boundaries: np.ndarray | None = None,
            windows: tuple[int, ...] = NOVELTY_WINDOWS) -> list[float]:
    """Per window w, the share of a token's experts absent from the sets of its request's last
    w tokens (tokens with fewer than w predecessors in their request are left out)."""
    T, L, k = router.shape
    n = int(router.max()) + 1
    if boundaries is None:
        boundaries = np.zeros(T, dtype=bool)
        boundaries[0] = True
    start = np.maximum.accumulate(np.where(boundaries, np.arange(T), 0))  # request's first
    ids = router.astype(np.int64)
    onehot = np.zeros((T, L, n), dtype=np.int32)
    np.put_along_axis(onehot, ids, 1, axis=2)
    seen_by = np.concatenate([np.zeros((1, L, n), np.int32), np.cumsum(onehot, axis=0)])
    out = []
    for w in windows:
        t = np.arange(w, T)
        t = t[t - w >= start[t]]
        if not len(t):
            out.append(float("nan"))
            continue
        counts = seen_by[t] - seen_by[t - w]  # occurrences in tokens t-w .. t-1
        out.append(float(1.0 - (np.take_along_axis(counts, ids[t], axis=2) > 0).mean()))
    return out


def load_entropy(router: np.ndarray, experts: int) -> float:
    """Mean over layers of the normalised entropy of the layer's expert loads."""
    out = []
    for layer in range(router.shape[1]):
        ids = router[:, layer].ravel()
        counts = np.bincount(ids[ids >= 0], minlength=experts).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        out.append(float(-(p * np.log(p)).sum() / np.log(experts)))
    return float(np.mean(out))


def adjacent_overlaps(router: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Overlap fraction of each adjacent pair of decode tokens within a request."""
    a, b = router[1:], router[:-1]
    same = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1) / router.shape[-1]
    return same[~boundaries[1:]]  # [pairs, layers]


def _routing(trace: Trace) -> _Routing:
    sets = routing_sets(trace)
    router = sets.router
    where = str(trace.path)
    if router.size == 0 or (router < 0).all():
        raise BadInput(f"{where}: no decode routing to fit routing statistics on")
    steps = trace.steps.filter(trace.steps["phase"] == "decode")
    request = dict(zip(steps["step"].to_list(), steps["request"].to_list(), strict=True))
    req = np.asarray([request.get(int(s), -1) for s in sets.step])
    boundaries = np.concatenate(([True], req[1:] != req[:-1]))
    pairs = adjacent_overlaps(router, boundaries)
    if len(pairs) < MIN_TOKENS:
        raise BadInput(f"{where}: {len(pairs)} adjacent decode tokens: too short to fit routing "
                       f"statistics (need at least {MIN_TOKENS})")
    experts = int((trace.run.get("model") or {}).get("experts") or int(router.max()) + 1)
    return _Routing(where, router, experts, len(pairs), float(pairs.mean()),
                    load_entropy(router, experts), novelty(router, boundaries))


def _fit(data: _Routing, recall: float, window: int) -> RoutingFit:
    """The skew that matches the trace's entropy at a given multi-token reuse, and the
    novelty the generator then gives."""
    router = data.router
    layers, k = router.shape[1], router.shape[2]
    skew = fit_skew(layers, data.experts, k, len(router), data.reuse, data.entropy, recall,
                    window)
    generated = [novelty(generate_sets(SynthRouting(
        layers=layers, experts=data.experts, k=k, steps=len(router), skew=skew,
        reuse=min(data.reuse, 0.95), recall=recall, window=window, seed=seed)).router)
        for seed in FIT_SEEDS]
    return RoutingFit(data.source, layers, data.experts, k, data.pairs, data.reuse,
                      data.entropy, skew, recall, window, data.novelty,
                      [float(v) for v in np.mean(generated, axis=0)])


def _novelty_error(fit: RoutingFit) -> float:
    diffs = [g - m for m, g in zip(fit.novelty or [], fit.novelty_generated or [], strict=True)
             if np.isfinite(m)]
    return float(np.sqrt(np.mean(np.square(diffs)))) if diffs else 0.0


def fit_trace(trace: Trace, recalls: tuple[float, ...] = RECALLS,
              windows: tuple[int, ...] = WINDOWS) -> RoutingFit:
    """Reuse, skew and multi-token reuse (recall, window) of one trace's decode routing (see
    the module docstring). BadInput when it is too short."""
    data = _routing(trace)
    best: tuple[float, RoutingFit] | None = None
    for recall in recalls:
        for window in windows if recall > 0 else windows[:1]:
            fit = _fit(data, recall, window)
            err = _novelty_error(fit)
            if best is None or err < best[0] - 1e-9:
                best = (err, fit)
    assert best is not None
    return best[1]


def fit_trace_at(trace: Trace, recall: float = 0.0, window: int = 16) -> RoutingFit:
    """Reuse and skew of one trace at a given multi-token reuse."""
    return _fit(_routing(trace), recall, window)


def fit_skew(layers: int, experts: int, k: int, steps: int, reuse: float,
             entropy: float, recall: float = 0.0, window: int = 16) -> float:
    """The Zipf exponent whose generated routing (same shape and length) has `entropy`."""
    def generated(skew: float) -> float:
        params = SynthRouting(layers=layers, experts=experts, k=k, steps=steps, skew=skew,
                              reuse=min(reuse, 0.95), recall=recall, window=window, seed=0)
        return load_entropy(generate_sets(params).router, experts)

    lo, hi = 0.0, 4.0
    if generated(lo) <= entropy:
        return 0.0  # as even as uniform routing can look at this length
    return decreasing_root(generated, entropy, lo, hi, 12)


def profile_values(fits: list[RoutingFit], prefix: str = "") -> dict[str, tuple[Any, str]]:
    """Model-profile keys (value, how): one entry per captured K, in ascending K (one fit per
    K: BadInput on two traces of the same K). prefix "prerouted_": traces routed by the
    prerouter's heads."""
    fits = sorted(fits, key=lambda f: f.k)
    ks = [f.k for f in fits]
    if len(set(ks)) != len(ks):
        raise BadInput(f"routing fit: two traces routed at the same K ({ks}): give one per K")
    per = "; ".join(f"K={f.k}: {f.tokens} token pairs of {f.source}, load entropy "
                    f"{f.load_entropy:.3f}, novelty {_fmt(f.novelty)} at "
                    f"{'/'.join(map(str, NOVELTY_WINDOWS))} tokens back (generated "
                    f"{_fmt(f.novelty_generated)})" for f in fits)
    values = {"routing_k": (ks, f"K of the traces fitted ({per})"),
              "routing_reuse": ([round(f.reuse, 4) for f in fits],
                                "mean adjacent-token overlap per K"),
              "routing_skew": ([round(f.skew, 4) for f in fits],
                               "Zipf exponent giving the traces' load entropy per K"),
              "routing_recall": ([f.recall for f in fits], "share of fresh draws copied from "
                                 "recent tokens, fitted to the traces' novelty per K"),
              "routing_recall_window": ([f.window for f in fits],
                                        "tokens back recall copies from, per K")}
    return {prefix + key: value for key, value in values.items()}


def _fmt(values: list[float] | None) -> str:
    return "/".join(f"{v:.2f}" for v in values or [])


def _decode_figures(result) -> dict[str, float | None]:
    steps = result.trace.steps.filter(result.trace.steps["phase"] == "decode")
    hits, misses = int(steps["cache_hits"].sum()), int(steps["cache_misses"].sum())
    cold = result.metrics["cold_fraction"]
    return {"mib_per_step": result.metrics["mib_per_step"],
            "loads_per_step": result.metrics["loads_per_step"],
            "page_cache_hit_rate": None if cold is None else 1.0 - cold,
            "app_cache_hit_rate": hits / (hits + misses) if hits + misses else None}


def check(trace: Trace, fit: RoutingFit, scenario: str, page_cache_fraction: float = 0.25,
          sets: list[str] | None = None) -> dict[str, dict[str, float | None]]:
    """Replay the trace's routing and the fitted generator's through one scenario, its
    page cache `page_cache_fraction` of the expert bytes: decode bytes and loads per step,
    page-cache hit rate (by load) and app-cache hit rate, side by side."""
    from sim.memory_budget import budget
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
    # the page cache stands for the captures' page-cache budget, which drops by recency
    sc = apply_overrides(sc, [f"os_reserve_gib={reserve:.9f}", "os_floor_gib=-1",
                              "page_cache_policy=lru"])
    routing = from_trace(trace, sc)
    # decode steps only, as the generator's: a prefill's whole-layer reads would warm the page
    # cache for the trace alone
    routing.plan = [p for p in routing.plan if p[0] == "decode"]
    replayed = _decode_figures(run_scenario(sc, routing=routing))
    synth = [_decode_figures(run_scenario(apply_overrides(
        sc, [f"overlap={fit.reuse:.4f}", f"skew={fit.skew:.4f}", f"recall={fit.recall}",
             f"recall_window={fit.window}", f"seed={seed}"]))) for seed in CHECK_SEEDS]
    return {name: {"trace": replayed[name],
                   "generated": None if synth[0][name] is None
                   else float(np.mean([s[name] for s in synth]))} for name in replayed}
