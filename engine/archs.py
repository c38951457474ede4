"""What differs between the supported mlx-lm MoE architectures, in one table.

After mlx-lm's `sanitize`, every supported architecture keeps its routed experts in a
`SwitchGLU` named `switch_mlp` with stacked [E, out, in] {gate,up,down}_proj; only the block's
attribute name, its router, its routing rule and its shared expert differ."""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.routing import RoutingSpec

# transformers (imported by mlx_lm) prints an advisory about PyTorch on import; the CLI promises
# one-line errors on stderr, so silence advisories before anything imports mlx_lm.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    moe_attr: str  # decoder-layer attribute holding the MoE block
    experts_key: str  # config key for the number of routed experts
    shared: str  # "", "gated" (qwen3_next shared_expert + sigmoid gate), "plain" (bailing)
    aggregate_cast: bool  # mlx-lm casts the weighted sum back to the expert output dtype
    flatten_tokens: bool = False  # olmoe routes x reshaped to [B*L, D]


ARCHS: dict[str, ArchSpec] = {
    "qwen3_moe": ArchSpec("qwen3_moe", "mlp", "num_experts", "", True),
    "mixtral": ArchSpec("mixtral", "block_sparse_moe", "num_local_experts", "", False),
    "olmoe": ArchSpec("olmoe", "mlp", "num_experts", "", False, flatten_tokens=True),
    "qwen3_next": ArchSpec("qwen3_next", "mlp", "num_experts", "gated", False),
    "bailing_moe": ArchSpec("bailing_moe", "mlp", "num_experts", "plain", True),
}


def arch_for(model_type: str) -> ArchSpec | None:
    return ARCHS.get(model_type)


def routing_spec(cfg: dict) -> RoutingSpec:
    """The routing rule mlx-lm applies for this config (see engine/routing.py)."""
    mt = cfg["model_type"]
    k = int(cfg["num_experts_per_tok"])
    if mt in ("qwen3_moe", "qwen3_next"):
        return RoutingSpec("softmax_topk", k, bool(cfg.get("norm_topk_prob", False)), "last")
    if mt == "mixtral":
        return RoutingSpec("softmax_topk", k, True, "first", on_logits=True)
    if mt == "olmoe":
        return RoutingSpec("softmax_topk", k, bool(cfg.get("norm_topk_prob", False)), "first")
    if mt == "bailing_moe":
        return RoutingSpec(
            "sigmoid_group", k, bool(cfg["norm_topk_prob"]), "last",
            n_group=int(cfg.get("n_group", 1)), topk_group=int(cfg.get("topk_group", 4)),
            scale=float(cfg.get("routed_scaling_factor", 1.0)),
            score_function=cfg.get("score_function", "softmax"),
        )
    raise ValueError(f"unsupported architecture {mt!r}")
