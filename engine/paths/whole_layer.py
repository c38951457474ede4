"""The whole-layer path (prefill): a layer's stacked tensors are read with one large read each
into one of two preallocated full-layer stacks, and the routed ids index them directly (no
host sync, the same gather over [E] rows as the resident model). A reader thread reads the
next whole-layer layer into the other stack while this layer computes:

  call for layer i:  mx.eval(x)            everything upstream is done (layer i-1's gather
                                           included), so the stack it used is free
                     submit read(i+1)      into that free stack, overlapping layer i's compute
                     wait read(i)          submitted by layer i-1's call (or now, for the first)
                     gather from stack(i)  lazily; evaluated by the next call's mx.eval(x)

One `WholeLayerLoader` per model holds the two stacks (2 x one layer's expert bytes) and is
shared by the layers' `WholeLayerPath`s; each path knows the next layer to read ahead."""

from __future__ import annotations

import mlx.core as mx

from contract.errors import BadInput
from engine.paths.kernel import ExpertPath, Quant, alloc_stack, switch_glu
from engine.paths.stats import PathStats
from engine.readers import ReaderPool, Ticket
from engine.store import ExpertStore


class WholeLayerLoader:
    def __init__(self, store: ExpertStore, readers: ReaderPool, stats: PathStats):
        m = store.manifest
        first = store.expert_shapes(m.moe_layers[0])
        if any(store.expert_shapes(i) != first for i in m.moe_layers):
            raise BadInput(f"{m.path('manifest.json')}: the whole-layer path needs every MoE "
                           "layer's experts to have the same shapes")
        self.store, self.readers, self.stats = store, readers, stats
        self.stacks = [alloc_stack(first, m.num_experts) for _ in range(2)]
        self.holds: list[int | None] = [None, None]  # layer read (or being read) into stack b
        self.tickets: list[Ticket | None] = [None, None]  # read in flight / not yet waited

    @property
    def nbytes(self) -> int:
        m = self.store.manifest
        return 2 * m.bundle_bytes * m.num_experts

    def _submit(self, b: int, layer: int, now: bool = False) -> None:
        self._settle_quietly(b)
        self.holds[b] = layer
        self.tickets[b] = self.readers.submit_layer(layer, self.stacks[b][1], now=now)

    def get(self, layer: int, x: mx.array, next_layer: int | None) -> dict[str, mx.array]:
        mx.eval(x)  # frees the stack the previous whole-layer call gathered from
        if layer in self.holds:
            b = self.holds.index(layer)
        else:
            b = 0 if self.tickets[0] is None else 1
            self._submit(b, layer, now=True)  # needed at once: no read ahead covered it
        if next_layer is not None and next_layer not in self.holds:
            self._submit(1 - b, next_layer)
        t, self.tickets[b] = self.tickets[b], None
        if t is not None:
            try:
                self.readers.wait([t])
            except BaseException:
                self.holds[b] = None
                self.reset()
                raise
        return self.stacks[b][0]

    def _settle_quietly(self, b: int) -> None:
        """Finish (and record) a read still in flight into stack b before reusing it: a read
        ahead that no call consumed, e.g. after a failed request."""
        t, self.tickets[b] = self.tickets[b], None
        self.holds[b] = None
        if t is not None:
            try:
                self.readers.wait([t])
            except Exception:  # noqa: BLE001 - nobody needs this read any more
                pass

    def reset(self) -> None:
        for b in (0, 1):
            self._settle_quietly(b)


class WholeLayerPath(ExpertPath):
    name = "whole-layer"

    def __init__(self, store: ExpertStore, layer: int, loader: WholeLayerLoader,
                 next_layer: int | None = None):
        self.store, self.layer, self.loader, self.next_layer = store, layer, loader, next_layer
        self.quant = Quant.of(store.manifest)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        stack = self.loader.get(self.layer, x, self.next_layer)
        return switch_glu(x, stack, inds, self.quant)
