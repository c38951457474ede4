"""The engine's app caches: a bundle cache shared by all layers (bounded in bytes: the hot pool,
or the paper's bundle LRU behind the slots) and the staged path's per-layer slot tables, each
evicting the victims of the run's eviction policy (Scenario.cache_policy, contract.eviction).
Values are the Load that brought the bundle in (None once it is known to have landed), so a
hit on a bundle still in flight waits for it instead of pretending it is there."""

from __future__ import annotations

from collections import deque

from contract.eviction import DEFAULT, EvictionPolicy, make
from sim.bounded_cache import BoundedCache


class BundleLRU(BoundedCache):
    """The shared cache of expert bundles keyed layer * experts + expert (least recently used
    first unless the policy says otherwise)."""


class SlotTables:
    """Per layer, the staged path's slot table (engine.paths.slot_table): `capacity` slots, one
    expert each. A missing expert takes an empty slot, else the policy's victim outside the
    protected ones (the last call's, which may still compute, and sets staged for calls to
    come); survivors keep theirs. Each layer's policy is stamped with that layer's calls, as the
    engine's table is. `pending` holds, per layer and oldest first, the sets staged for future
    calls (expert -> the Load bringing it in, or None when it was already held): with the
    lookahead loop the token after next is staged before the next token's layer has taken its
    set, as the engine's per-layer queue of staged sets allows."""

    def __init__(self, layers: int, capacity: int, policy: str = DEFAULT) -> None:
        self.capacity = capacity
        self.held: list[dict[int, object]] = [{} for _ in range(layers)]
        self.policies: list[EvictionPolicy] = [make(policy) for _ in range(layers)]
        self.calls = [0] * layers  # the engine table's clock (SlotTable.clock)
        self.last_call: list[frozenset[int]] = [frozenset()] * layers
        self.pending: list[deque[dict[int, object]]] = [deque() for _ in range(layers)]
        self.evictions = 0

    def protected(self, layer: int, last_call: bool) -> set[int]:
        """Experts no new read may displace: those staged ahead and (`last_call`: its step may
        still compute) the last call's."""
        out = set(self.last_call[layer]) if last_call else set()
        for staged in self.pending[layer]:
            out.update(staged)
        return out

    def touch(self, layer: int, experts: list[int]) -> None:
        """A call on `layer` wants `experts`: a new tick of its clock, the held ones used."""
        self.calls[layer] += 1
        held, policy, now = self.held[layer], self.policies[layer], (self.calls[layer], layer)
        for e in experts:
            if e in held:
                policy.use(e, now)

    def place(self, layer: int, expert: int, load: object, protected: set[int]) -> None:
        """Give `expert` (not held) a slot, its read `load` in flight: an empty slot, else the
        policy's victim outside `protected`. With every slot protected (the engine raises
        StagingError; sim.profiles requires the headroom that rules it out) the policy's first
        goes."""
        held, policy, now = self.held[layer], self.policies[layer], (self.calls[layer], layer)
        if len(held) >= self.capacity:
            victim = policy.victim(now, protected)
            if victim is None:
                victim = policy.victim(now)
            del held[victim]
            policy.remove(victim)
            self.evictions += 1
        held[expert] = load
        policy.admit(expert, now)

    def landed(self, layer: int, expert: int) -> None:
        held = self.held[layer]
        if expert in held:
            held[expert] = None

    def stage(self, layer: int, staged: dict[int, object]) -> None:
        self.pending[layer].append(staged)

    def take(self, layer: int) -> dict[int, object] | None:
        """The oldest set staged for this layer's next call (None if nothing staged)."""
        pending = self.pending[layer]
        return pending.popleft() if pending else None

    def settle(self, layer: int, experts: frozenset[int]) -> None:
        """The call ran with `experts`: they are the last call's set now."""
        self.last_call[layer] = experts
