"""Same-token lead (Pre-gated MoE's one-layer lead, lead kind "layer"): layer N+1's routing is
predicted from layer N's post-attention-norm state of the SAME token by applying layer N+1's
own router to it, and that prediction IS layer N+1's routing, as with the prerouter's heads.
The predictor is the untrained "next router on this state" (no trained same-token heads).

Where the reads go: on the staged path the prediction for N+1 is ready when this step's compute
reaches layer N's MoE input, the same moment layer N's own ids are; so N+1's reads start when
layer N's fill point is resolved and overlap layer N's reads and expert compute
(engine.fill_points `early` points). The price is what Pre-gated pays in a streaming engine:
each layer's ids still come to the host during the step, one sync per layer, and the read
window is one layer's compute instead of a whole step (the prerouter's token lead).

Calls of more than one token (prefill) route themselves; the first MoE layer always does.
The interface is the prerouter link's (engine.prerouter.PrerouteLink): `routing`, `observe`,
`reset`, `pending`."""

from __future__ import annotations

import mlx.core as mx

from engine.routing import route


class LayerLead:
    same_token = True

    def __init__(self, blocks: dict) -> None:
        """`blocks`: {layer: StreamingMoE}; each layer followed by a MoE layer predicts it."""
        self.next = {n: blocks[n + 1] for n in blocks if n + 1 in blocks}
        self.consumers = sorted(n + 1 for n in self.next)
        self.reset()

    def reset(self) -> None:
        self.ahead: dict[int, tuple[mx.array, mx.array]] = {}

    def routing(self, layer: int, tokens: int) -> tuple[mx.array, mx.array] | None:
        """The (ids, weights) predicted for this call of `layer` by the layer before it."""
        pred = self.ahead.pop(layer, None)
        return pred if tokens == 1 else None

    def observe(self, layer: int, x: mx.array, inds: mx.array) -> None:
        """After `layer` routed, on a single-token call: predict the next layer's routing
        from this layer's input state with the next layer's router."""
        nxt = self.next.get(layer)
        if nxt is None or x.size // x.shape[-1] != 1:
            return
        logits, bias = nxt.router_logits(x)
        self.ahead[layer + 1] = route(nxt.spec, logits, bias)

    def pending(self) -> dict[int, mx.array]:
        """Nothing is predicted for the next call (the decode loop asks the prerouter)."""
        return {}


def install(blocks: dict) -> LayerLead:
    link = LayerLead(blocks)
    for block in blocks.values():
        block.preroute = link
    return link
