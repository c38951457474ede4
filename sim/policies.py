"""Policies: the engine's decode paths (contract.engine_config.PATHS) and leads (LEADS) as the
simulator runs them: which experts each layer executes, where their bundles are looked for,
when they are asked for, and who waits.

  exact   every layer runs its router, syncs the indices to the host, and reads every routed
          expert on the main thread (no app cache; the page cache still holds what was read).
  hot     the same through one byte-bounded bundle LRU shared by all layers (lru_bytes: the hot
          budget), read by the reader threads.
  staged  per layer a slot table of K + staged_headroom slots, least recently used victim
          (engine.paths.slot_table, sim.caches.SlotTables); with lru_bytes a bundle LRU shared
          by all layers sits behind the slots (the paper's engine has one, ours none). The lead
          says how the routing becomes known (engine.paths.staged_fill):
    none   on demand: the layer's router, synced to the host, then the missing experts are read.
    token  prediction heads (the paper): at each step boundary the heads' predictions for every
           consumer layer are flushed at once and staged, so the read window is a whole step.
           With prediction_is_routing the staged set IS the executed set (no router, no sync, no
           fallback loads); otherwise the router still runs and routed experts that were not
           predicted become demand loads. Layers outside the model's consumer range run on
           demand.
    layer  same token, lead_layers ahead (pre-gated style; the engine's layer lead is 1): after
           layer L's router the set of layer L+N is predicted and staged; the router of L+N
           decides, misses are demand loads.
Prediction accuracy comes from the trace's predicted sets when it has them; otherwise predicted
sets are the routed sets with each expert kept with probability `prediction_accuracy` and
otherwise replaced by a random expert outside the set (`perturb`).
"""

from __future__ import annotations

import numpy as np

from sim.scenario import Scenario


class Policy:
    """The exact path: the router's set, read on demand, nothing kept."""
    slots = False  # experts stay in a per-layer slot table (the staged path)
    app_cache = False  # looked up in the shared bundle LRU
    fresh_stack = False  # each call allocates a zeroed stack for its experts (the exact path)

    def __init__(self, sc: Scenario, router: np.ndarray, predicted: np.ndarray | None) -> None:
        self.sc = sc
        # nested lists [step][layer] -> K expert ids (indexing lists beats numpy per element)
        self.router = router.tolist()  # each layer's own router choice
        self.predicted = predicted.tolist() if predicted is not None else None

    def staged_layer(self, layer: int) -> bool:
        """Routing known ahead and executed as staged: no router sync at this layer."""
        return False

    def executed(self, step: int, layer: int) -> list[int]:
        return self.router[step][layer]

    def boundary(self, step: int) -> list[tuple[int, list[int]]]:
        """(layer, predicted set) staged at the boundary before `step`."""
        return []

    def after_router(self, step: int, layer: int) -> list[tuple[int, list[int]]]:
        """(later layer, predicted set) staged right after `layer`'s router, same token."""
        return []

    def head_owner(self, layer: int) -> bool:
        return False


class Exact(Policy):
    fresh_stack = True  # a zeroed stack allocated per call (engine.paths.exact.fetch)


class Hot(Policy):
    """The hot path: the shared LRU is the only app cache."""
    app_cache = True


class Staged(Policy):
    """The staged path filled on demand (lead none)."""
    slots = True
    app_cache = True  # the bundle LRU behind the slots (0 bytes: none, as in our engine)


class StagedTokenLead(Staged):
    """One flush per step of all consumer layers' predictions, one token ahead."""

    def __init__(self, sc: Scenario, router: np.ndarray, predicted: np.ndarray | None) -> None:
        super().__init__(sc, router, predicted)
        m = sc.model
        self.consumers = [layer for layer in range(m.layers) if m.is_consumer(layer)]
        first_owner = m.consumer_first - 1
        self.owners = set(range(first_owner, first_owner + m.heads)) if self.consumers else set()
        self.as_routing = sc.prediction_is_routing
        self._consumer = np.zeros(m.layers, dtype=bool)
        self._consumer[self.consumers] = True

    def staged_layer(self, layer: int) -> bool:
        return self.as_routing and bool(self._consumer[layer])

    def executed(self, step: int, layer: int) -> list[int]:
        if self.staged_layer(layer):
            return self.predicted[step][layer]
        return self.router[step][layer]

    def boundary(self, step: int) -> list[tuple[int, list[int]]]:
        pred = self.predicted[step]
        return [(layer, pred[layer]) for layer in self.consumers]

    def head_owner(self, layer: int) -> bool:
        return layer in self.owners


class StagedLayerLead(Staged):
    """Same-token lead of N layers: predict layer L+N right after layer L's router."""

    def __init__(self, sc: Scenario, router: np.ndarray, predicted: np.ndarray | None) -> None:
        super().__init__(sc, router, predicted)
        self.lead = sc.lead_layers
        self.model = sc.model

    def after_router(self, step: int, layer: int) -> list[tuple[int, list[int]]]:
        target = layer + self.lead
        if target < self.model.layers and self.model.is_consumer(target):
            return [(target, self.predicted[step][target])]
        return []

    def head_owner(self, layer: int) -> bool:
        target = layer + self.lead
        return target < self.model.layers and self.model.is_consumer(target)


def perturb(router: np.ndarray, accuracy: float, experts: int, seed: int) -> np.ndarray:
    """Predicted sets: each routed expert kept with probability `accuracy`, else replaced by a
    uniformly random expert not in the set (so a prediction is still a set of K experts)."""
    if accuracy >= 1.0:
        return router.copy()
    rng = np.random.default_rng(seed)
    out = router.astype(np.int32, copy=True)
    flat = out.reshape(-1, out.shape[-1])
    wrong = rng.random(flat.shape) >= accuracy
    for row in np.flatnonzero(wrong.any(axis=1)):
        members = set(flat[row].tolist())
        for col in np.flatnonzero(wrong[row]):
            while True:
                e = int(rng.integers(experts))
                if e not in members:
                    break
            members.discard(int(flat[row, col]))
            members.add(e)
            flat[row, col] = e
    return out.astype(router.dtype)


def make_policy(sc: Scenario, router: np.ndarray, predicted: np.ndarray | None) -> Policy:
    if sc.path == "exact":
        return Exact(sc, router, predicted)
    if sc.path == "hot":
        return Hot(sc, router, predicted)
    if sc.path != "staged":
        raise ValueError(f"unknown path {sc.path!r}")
    if sc.lead == "none":
        return Staged(sc, router, predicted)
    if predicted is None and sc.lead == "token" and sc.prediction_is_routing:
        # Prediction as routing with no measured predictions: the routing we were given is
        # taken to be what the heads predicted (it is what executes either way).
        predicted = router
    elif predicted is None:
        predicted = perturb(router, sc.prediction_accuracy, sc.model.experts, sc.seed + 1)
    if sc.lead == "token":
        return StagedTokenLead(sc, router, predicted)
    return StagedLayerLead(sc, router, predicted)
