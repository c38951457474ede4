"""The hot path: one cache of expert bundles shared by every layer, bounded in BYTES, held in one
preallocated stacked pool (rows = budget // bundle bytes, plus a zero row). The routed ids
come to the host; each distinct (layer, expert) is looked up: hits use their pool row, misses
are read by reader threads into the rows of the victims the eviction policy names
(contract.eviction; least recently used by default), and the call
gathers from the pool through a per-layer table (an MLX uint32 array [E], expert -> row; the
zero row for experts not in the pool), so the gather never needs the ids on the host. A call
with more distinct experts than the pool holds (a long prefill) falls back to the exact path
for that call and leaves the pool alone.

When: inside the decode loop (`FillPoints.collecting`) a single-token call only builds the
gather and registers a fill point (engine.fill_points), resolved during evaluation while the
next step is built, as the staged path does; elsewhere the call syncs at build time. Either
way the lookup happens after everything upstream is evaluated, including earlier layers'
gathers from the pool (layer l's ids depend on them), so overwriting a row is safe; the rows
of the current call are pinned while its misses pick victims."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from contract import eviction
from contract.errors import BadInput
from engine.fill_points import FillPoint, FillPoints
from engine.paths.exact import ExactPath
from engine.paths.kernel import ExpertPath, Quant, alloc_stack, row_targets, switch_glu
from engine.paths.stats import PathStats, host_routed
from engine.readers import ReaderPool
from engine.store import ExpertStore


def min_hot_bytes(store: ExpertStore) -> int:
    """One layer's decode working set: K bundles."""
    return store.manifest.top_k * store.manifest.bundle_bytes


class HotPool:
    def __init__(self, store: ExpertStore, readers: ReaderPool, stats: PathStats,
                 budget_bytes: int, policy: str = eviction.DEFAULT):
        m = store.manifest
        shapes = {store.expert_shapes(i)[n] == store.expert_shapes(m.moe_layers[0])[n]
                  for i in m.moe_layers for n in store.expert_shapes(i)}
        if shapes != {True}:
            raise BadInput(f"{m.path('manifest.json')}: the hot path needs every MoE layer's "
                           "experts to have the same shapes")
        need = min_hot_bytes(store)
        if budget_bytes < need:
            raise BadInput(f"hot LRU budget {budget_bytes} bytes is smaller than one layer's "
                           f"working set: minimum {need} bytes (K={m.top_k} bundles of "
                           f"{m.bundle_bytes} bytes)")
        self.store, self.readers, self.stats = store, readers, stats
        self.rows = min(budget_bytes // m.bundle_bytes, m.num_experts * len(m.moe_layers))
        self.budget_bytes = budget_bytes
        # rows 0..rows-1, then the zero row `rows` that experts not in the pool map to
        self.arrays, self.views = alloc_stack(store.expert_shapes(m.moe_layers[0]),
                                              self.rows + 1)
        self.targets = row_targets(self.views, self.rows)
        self.row_of: dict[tuple[int, int], int] = {}  # (layer, expert) -> row
        self.policy = eviction.make(policy)  # over the (layer, expert) keys of row_of
        self.free = list(range(self.rows - 1, -1, -1))
        self.tables = {i: mx.full((m.num_experts,), self.rows, dtype=mx.uint32)
                       for i in m.moe_layers}  # layer -> expert -> row, on the device
        mx.eval(list(self.tables.values()))
        self.tables_np = {i: np.asarray(t) for i, t in self.tables.items()}  # zero-copy

    def clear(self) -> None:
        """Empty the pool: every expert reads again on next use."""
        self.row_of.clear()
        self.policy.clear()
        self.free = list(range(self.rows - 1, -1, -1))
        for t in self.tables_np.values():
            t[:] = self.rows

    def forget(self, layers: set[int]) -> None:
        """Drop the experts of `layers`: they read again on next use."""
        for key in [k for k in self.row_of if k[0] in layers]:
            self.free.append(self.row_of.pop(key))
            self.policy.remove(key)
            self.tables_np[key[0]][key[1]] = self.rows

    @property
    def nbytes(self) -> int:
        return self.rows * self.store.manifest.bundle_bytes

    def rows_for(self, layer: int, experts: list[int], token: int) -> dict[int, int] | None:
        """{expert: row} with every expert resident (reads the misses, waits for them), or
        None when the set is larger than the pool (caller falls back to exact). `token`: the
        step the call belongs to (the policy's stamps are (token, layer))."""
        if len(experts) > self.rows:
            return None
        now = (token, layer)
        out, missing = {}, []
        for e in experts:
            row = self.row_of.get((layer, e))
            if row is None:
                missing.append(e)
            else:
                self.policy.use((layer, e), now)
                out[e] = row
        self.stats.cache_hits += len(out)
        self.stats.cache_misses += len(missing)
        keep = {(layer, e) for e in out}  # this call's rows are pinned
        tickets = []
        for e in missing:
            if self.free:
                row = self.free.pop()
            else:
                victim = self.policy.victim(now, keep)
                self.policy.remove(victim)
                row = self.row_of.pop(victim)
                self.tables_np[victim[0]][victim[1]] = self.rows
                self.stats.cache_evictions += 1
            keep.add((layer, e))
            out[e] = row
            tickets.append((e, row, self.readers.submit_bundle(layer, e, self.targets[row],
                                                                   now=True)))
        try:
            self.readers.wait([t for _, _, t in tickets])
        finally:
            for e, row, t in tickets:
                if t.error is None:
                    self.row_of[(layer, e)] = row
                    self.policy.admit((layer, e), now)
                    self.tables_np[layer][e] = row
                else:
                    self.free.append(row)
        return out


class HotPath(ExpertPath):
    name = "hot"

    def __init__(self, store: ExpertStore, layer: int, pool: HotPool,
                 points: FillPoints | None = None):
        self.store, self.layer, self.pool, self.stats = store, layer, pool, pool.stats
        self.points = points
        self.quant = Quant.of(store.manifest)
        self.exact = ExactPath(store, layer,
                               step_clock=points.clock if points is not None else None,
                               stats=self.stats)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        tokens = inds.size // inds.shape[-1]
        points = self.points
        if tokens == 1 and points is not None and points.active:
            points.progress()  # the step being evaluated: fill its next layer meanwhile
            out = self._gather(x, inds)
            points.defer(FillPoint(self._fill), inds, out)
            return out
        host = host_routed(inds, self.stats)
        if not self._lookup(host):
            self.stats.exact_fallbacks += 1
            self.stats.cache_misses += len(set(host.ravel().tolist()))
            return self.exact(x, inds)
        return self._gather(x, inds)

    def _fill(self, inds: mx.array) -> None:
        """Fill point: the routed ids to the host, misses read into the pool. It runs while the
        compute thread waits, so the usual case (every routed expert published in this
        layer's table) only refreshes recency."""
        experts = set(host_routed(inds, self.stats, deferred=True).ravel().tolist())
        pool, layer = self.pool, self.layer
        table, absent = pool.tables_np[layer], pool.rows
        now = (self.points.clock.step, layer)
        if any(table[e] == absent for e in experts):
            pool.rows_for(layer, sorted(experts), now[0])
            return
        for e in experts:
            pool.policy.use((layer, e), now)
        self.stats.cache_hits += len(experts)

    def _lookup(self, host) -> bool:
        """Make every routed expert resident in the pool (published in this layer's table);
        False when the set is larger than the pool."""
        token = self.points.clock.step if self.points is not None else -1
        return self.pool.rows_for(self.layer, sorted(set(host.ravel().tolist())),
                                  token) is not None

    def _gather(self, x: mx.array, inds: mx.array) -> mx.array:
        local = mx.take(self.pool.tables[self.layer], inds)
        return switch_glu(x, self.pool.arrays, local, self.quant)
