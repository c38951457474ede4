"""The streaming MoE block: replaces a decoder layer's MoE block after loading
(`layer.mlp = StreamingMoE(...)`, `layer.block_sparse_moe` for mixtral). It keeps the original
block's resident parts under their original names (router `gate` or `router`, shared experts)
so resident weights load by their mlx-lm names, and hands the routed experts to an execution
path.

Per call: router logits (resident) -> engine.routing (or, with a prerouter, the routing its
head predicted for this layer one token earlier) -> optional `on_routing(layer, inds,
weights)` -> path(x, inds) [..., K, D] -> weighted sum (mlx-lm's exact op order) -> + shared.
The path is chosen per call: `prefill_path` when the call carries more than one token and one
is set, else `path`. Swap paths freely (`block.path = ...`): every path shares the kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from engine.archs import ArchSpec
from engine.paths.kernel import ExpertPath
from engine.routing import RoutingSpec, route

RoutingCallback = Callable[[int, mx.array, mx.array], None]


class StreamingMoE(nn.Module):
    def __init__(
        self,
        layer: int,
        block: nn.Module,
        arch: ArchSpec,
        spec: RoutingSpec,
        path: ExpertPath,
        prefill_path: ExpertPath | None = None,
        on_routing: RoutingCallback | None = None,
    ):
        super().__init__()
        # the router under its mlx-lm name (engine.archs: router kinds)
        setattr(self, arch.router_attr, getattr(block, arch.router_attr))
        if arch.shared == "gated":
            self.shared_expert = block.shared_expert
            self.shared_expert_gate = block.shared_expert_gate
        elif arch.shared == "plain" and getattr(block, "shared_experts", None) is not None:
            self.shared_experts = block.shared_experts
        # Plain attributes (not arrays/modules/containers) stay out of the parameter tree.
        self.layer_index = layer
        self.arch = arch
        self.spec = spec
        self.path = path
        self.prefill_path = prefill_path
        self.on_routing = on_routing
        # engine.prerouter.PrerouteLink (heads, a token ahead) or engine.layer_lead.LayerLead
        # (this token, a layer ahead): predicted routing, when one is installed
        self.preroute = None

    @property
    def router(self) -> nn.Module:
        return self[self.arch.router_attr]

    def router_logits(self, x: mx.array) -> tuple[mx.array, mx.array | None]:
        """(logits [..., E], expert bias or None) from the resident router."""
        kind, gate = self.arch.router, self.router
        if kind == "bailing":
            return gate.gate_proj(x), self.expert_bias()
        if kind == "deepseek":
            return x @ gate.weight.T, self.expert_bias()
        return gate(x), None

    def expert_bias(self) -> mx.array | None:
        """The expert bias routing adds to the scores (sigmoid-group routers), else None."""
        kind = self.arch.router
        if kind == "bailing":
            return getattr(self.router, "expert_bias", None)
        if kind == "deepseek":
            return self.router.e_score_correction_bias
        return None

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        if self.arch.flatten_tokens:  # olmoe routes [B*L, D]
            x = x.reshape(-1, shape[-1])
        tokens = x.size // x.shape[-1]
        link = self.preroute
        predicted = link.routing(self.layer_index, tokens) if link is not None else None
        if predicted is not None:  # routing predicted one token ahead: the router does not run
            inds, weights = (a.reshape(*x.shape[:-1], -1) for a in predicted)
        else:
            logits, bias = self.router_logits(x)
            inds, weights = route(self.spec, logits, bias)
        if link is not None:
            link.observe(self.layer_index, x, inds)
        if self.on_routing is not None:
            self.on_routing(self.layer_index, inds, weights)
        path = self.prefill_path if tokens > 1 and self.prefill_path is not None else self.path
        if predicted is not None and path.takes_predicted:
            # known ahead (a token, or a layer of this token): staged, no router sync
            out = path.predicted(x, inds, early=link.same_token)
        else:
            out = path(x, inds)
        y = (out * weights[..., None]).sum(axis=-2)
        if self.arch.aggregate_cast:
            y = y.astype(out.dtype)
        if self.arch.shared == "gated":
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y.reshape(shape) if self.arch.flatten_tokens else y
