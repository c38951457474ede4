"""What the simulator replays: dense routing arrays plus the step plan, from a trace or from the
synthetic generator (sim.routing_synth, shared with the tests and the paper report)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from contract.errors import BadInput
from sim.routing_synth import SynthRouting, generate_sets, routing_sets
from sim.scenario import ROUTING_KEYS, ModelProfile, Scenario
from traces.reader import Trace

PlanStep = tuple[str, int, int, int]  # (phase, tokens, request, routing row or -1)
# A prefill step of one token (mlx-lm's prefill ends on the prompt's last token, one call)
# runs the engine's decode path (StreamingMoE: a call's phase is its token count): replayed
# through the decode path, recorded as prefill. sim.main_thread.MainThread.run
PREFILL_TOKEN = "prefill-token"
DECODE_PATH_STEPS = ("decode", PREFILL_TOKEN)  # plan phases that run the decode path


@dataclass
class RoutingInput:
    router: np.ndarray  # int16 [rows, layers, K]: each layer's own router choice
    predicted: np.ndarray | None  # int16 [rows, layers, K]; router where nothing was predicted
    plan: list[PlanStep]
    source: str  # "synthetic" or the trace directory
    # routing row -> [(layer, experts)] read ahead from the step's token before the layer
    # routed (a trace's first-layer hints: engine.first_layer_hint)
    hints: dict[int, list[tuple[int, list[int]]]] = field(default_factory=dict)

    @property
    def decode_steps(self) -> int:
        return sum(1 for p in self.plan if p[0] == "decode")


def _merge_predicted(router: np.ndarray, predicted: np.ndarray) -> np.ndarray | None:
    have = predicted[..., 0] >= 0
    if not have.any():
        return None
    return np.where(have[..., None], predicted, router).astype(np.int16)


def at_k(m: ModelProfile, k: int, prefix: str = "") -> tuple[float, float, float, int]:
    """(reuse, skew, recall, window) of the model's fitted routing at K: linear between the
    captured K, the nearest captured K outside them. prefix "prerouted_": the heads' routing."""
    ks = np.asarray(getattr(m, f"{prefix}routing_k"), dtype=np.float64)
    reuse, skew, recall, window = (
        float(np.interp(k, ks, np.asarray(getattr(m, prefix + key), dtype=np.float64)))
        for key in ROUTING_KEYS[1:])
    return min(reuse, 0.95), skew, recall, max(int(round(window)), 1)


def synthetic_params(sc: Scenario) -> SynthRouting:
    m = sc.model
    predicted_layers = None
    accuracy = None
    if sc.predicts and not (sc.lead == "token" and sc.prediction_is_routing):
        # predictions only matter where they are not the routing itself (see sim.policies)
        accuracy = sc.prediction_accuracy
        predicted_layers = [layer for layer in range(m.layers) if m.is_consumer(layer)] or None
    reuse, skew, recall, window = sc.overlap, sc.skew, sc.recall, sc.recall_window
    if sc.routing_stats == "model":  # fitted to the model's traces, at this K
        # the token lead routes by the heads' predictions: their own statistics, when fitted
        heads = sc.lead == "token" and sc.prediction_is_routing and m.prerouted_routing_k
        reuse, skew, recall, window = at_k(m, sc.k, "prerouted_" if heads else "")
    return SynthRouting(layers=m.layers, experts=m.experts, k=sc.k,
                        steps=max(sc.decode_steps, 1), skew=skew, reuse=reuse,
                        recall=recall, window=window,
                        prediction_accuracy=accuracy, predicted_layers=predicted_layers,
                        seed=sc.seed)


# The last few synthetic routings of this process, by their parameters: a sweep's points
# mostly vary hardware or caches, not routing, and generating it is ~15% of a point.
_SYNTHETIC: dict[tuple[str, int, int], RoutingInput] = {}
_SYNTHETIC_KEEP = 4


def synthetic(sc: Scenario) -> RoutingInput:
    params = synthetic_params(sc)
    key = (repr(params), sc.prefill_tokens, sc.decode_steps)
    if key in _SYNTHETIC:
        return _SYNTHETIC[key]
    try:
        sets = generate_sets(params)
    except ValueError as err:
        raise BadInput(f"{sc.source or sc.name}: synthetic routing: {err}") from None
    plan: list[PlanStep] = []
    if sc.prefill_tokens:
        plan.append(("prefill", sc.prefill_tokens, 0, -1))
    plan += [("decode", 1, 0, i) for i in range(sc.decode_steps)]
    routing = RoutingInput(sets.router, _merge_predicted(sets.router, sets.predicted), plan,
                           "synthetic")
    for array in (routing.router, routing.predicted):
        if array is not None:
            array.flags.writeable = False  # shared by the runs that reuse it
    if len(_SYNTHETIC) >= _SYNTHETIC_KEEP:
        _SYNTHETIC.pop(next(iter(_SYNTHETIC)))
    _SYNTHETIC[key] = routing
    return routing


def from_trace(trace: Trace, sc: Scenario) -> RoutingInput:
    """The trace's steps in order (prefill steps by token count, decode steps by routing)."""
    m = sc.model
    where = trace.path
    model = trace.run.get("model") or {}
    for key, want in (("layers", m.layers), ("experts", m.experts)):
        got = model.get(key)
        if got is not None and int(got) != want:
            raise BadInput(f"{where}: run.json model.{key}={got} but model profile {m.name!r} "
                           f"has {want}")
    sets = routing_sets(trace)
    rows, layers, k = sets.router.shape
    if rows == 0:
        raise BadInput(f"{where}: no decode routing to replay")
    if layers != m.layers:
        raise BadInput(f"{where}: routing has {layers} layers, model {m.name!r} has {m.layers}")
    if (sets.router < 0).any():
        raise BadInput(f"{where}: decode routing is missing some (step, layer) rows")
    if k != sc.k:
        raise BadInput(f"{where}: the trace routes K={k}; scenario k={sc.k} (set k={k})")
    row_of = {int(s): i for i, s in enumerate(sets.step)}
    router, predicted = sets.router, sets.predicted
    # one-token prefill steps on the decode path: only without a lead (no heads run at prefill;
    # what a lead's staging does there is not recorded)
    token_rows = single_token_prefill(trace, layers, k) if sc.lead == "none" else {}
    if token_rows:
        first = len(router)
        extra = np.stack(list(token_rows.values()))
        router = np.concatenate([router, extra])
        predicted = np.concatenate([predicted, np.full_like(extra, -1)])
        row_of.update({step: first + i for i, step in enumerate(token_rows)})
    plan: list[PlanStep] = []
    steps = trace.steps.sort("step")
    for step, phase, tokens, request in steps.select(
            "step", "phase", "tokens", pl.col("request").fill_null(0)).iter_rows():
        if phase == "prefill" and int(step) in token_rows:
            plan.append((PREFILL_TOKEN, 1, int(request), row_of[int(step)]))
        elif phase == "prefill":
            plan.append(("prefill", int(tokens or 1), int(request), -1))
        elif int(step) in row_of:
            plan.append(("decode", 1, int(request), row_of[int(step)]))
    return RoutingInput(router, _merge_predicted(router, predicted), plan, str(where),
                        hints_of(trace, row_of))


def hints_of(trace: Trace, row_of: dict[int, int]) -> dict[int, list[tuple[int, list[int]]]]:
    """{routing row: [(layer, hinted experts)]} of the trace's steps that `row_of` replays."""
    rows = trace.routing.filter(pl.col("hinted_experts").is_not_null())
    out: dict[int, list[tuple[int, list[int]]]] = {}
    for step, layer, experts in rows.select("step", "layer", "hinted_experts").iter_rows():
        if int(step) in row_of:
            out.setdefault(row_of[int(step)], []).append((int(layer), list(experts)))
    return out


def single_token_prefill(trace: Trace, layers: int, k: int) -> dict[int, np.ndarray]:
    """{step: [layers, K] router sets} of the trace's one-token prefill steps whose routing is
    recorded at every layer (router_experts where recorded, else the router rows' experts)."""
    steps = trace.steps.filter((pl.col("phase") == "prefill") & (pl.col("tokens") == 1))
    if not steps.height:
        return {}
    rows = trace.routing.join(steps.select("step"), on="step", how="inner").filter(
        pl.col("experts").is_not_null() & (pl.col("source") != "prediction"))
    out: dict[int, np.ndarray] = {}
    for (step,), group in rows.group_by(["step"], maintain_order=True):
        sets = np.full((layers, k), -1, dtype=np.int16)
        for layer, experts, router in group.select(
                "layer", "experts", "router_experts").iter_rows():
            chosen = router if router is not None else experts
            if 0 <= layer < layers and len(chosen) == k:
                sets[layer] = chosen
        if (sets >= 0).all():
            out[int(step)] = sets
    return dict(sorted(out.items()))
