"""What differs between the supported mlx-lm MoE architectures, in one table.

After mlx-lm's `sanitize`, every supported architecture keeps its routed experts in a
`SwitchGLU` (`switch_mlp`; gpt_oss: `experts`) with stacked [E, out, in] {gate,up,down}_proj.
What differs: the block's attribute name, the router (its attribute, how its logits and expert
bias are read), the routing rule, the shared expert, and the experts' activation and biases.

Router kinds:
  linear    `gate(x)` is the logits (an nn.Linear; gpt_oss's `router` has a bias)
  bailing   `gate.gate_proj(x)`, expert bias `gate.expert_bias`
  deepseek  `x @ gate.weight.T`, expert bias `gate.e_score_correction_bias` (deepseek_v3,
            glm4_moe, glm_moe_dsa: mlx-lm's MoEGate, which routes inside; the engine reads
            its weights and routes with engine.routing)"""

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
    router: str = "linear"  # see the module docstring
    router_attr: str = "gate"  # block attribute holding the router
    experts_attr: str = "switch_mlp"  # block attribute holding the routed SwitchGLU
    activation: str = "swiglu"  # engine.paths.kernel.ACTIVATIONS


ARCHS: dict[str, ArchSpec] = {
    "qwen3_moe": ArchSpec("qwen3_moe", "mlp", "num_experts", "", True),
    "mixtral": ArchSpec("mixtral", "block_sparse_moe", "num_local_experts", "", False),
    "olmoe": ArchSpec("olmoe", "mlp", "num_experts", "", False, flatten_tokens=True),
    "qwen3_next": ArchSpec("qwen3_next", "mlp", "num_experts", "gated", False),
    "bailing_moe": ArchSpec("bailing_moe", "mlp", "num_experts", "plain", True,
                            router="bailing"),
    "deepseek_v3": ArchSpec("deepseek_v3", "mlp", "n_routed_experts", "plain", True,
                            router="deepseek"),
    "glm4_moe": ArchSpec("glm4_moe", "mlp", "n_routed_experts", "plain", True,
                         router="deepseek"),
    "glm_moe_dsa": ArchSpec("glm_moe_dsa", "mlp", "n_routed_experts", "plain", True,
                            router="deepseek"),
    "gpt_oss": ArchSpec("gpt_oss", "mlp", "num_local_experts", "", False, router_attr="router",
                        experts_attr="experts", activation="swiglu_oai"),
}
DEEPSEEK_FAMILY = ("deepseek_v3", "glm4_moe", "glm_moe_dsa")


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
    if mt in DEEPSEEK_FAMILY:  # mlx-lm's group_expert_select with the noaux_tc method
        if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or \
                cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"{mt}: routing {cfg.get('topk_method')!r} / "
                             f"{cfg.get('scoring_func')!r} is not supported (noaux_tc, sigmoid)")
        return RoutingSpec(
            "sigmoid_group", k, bool(cfg.get("norm_topk_prob", True)), "first",
            n_group=int(cfg.get("n_group", 1)), topk_group=int(cfg.get("topk_group", 1)),
            scale=float(cfg.get("routed_scaling_factor", 1.0)), eps=0.0, cast_weights=False,
        )
    if mt == "gpt_oss":  # softmax over the top-k logits (torch.topk order: mlx-lm's mlx_topk)
        return RoutingSpec("softmax_topk", k, True, "last", on_logits=True)
    if mt == "bailing_moe":
        return RoutingSpec(
            "sigmoid_group", k, bool(cfg["norm_topk_prob"]), "last",
            n_group=int(cfg.get("n_group", 1)), topk_group=int(cfg.get("topk_group", 4)),
            scale=float(cfg.get("routed_scaling_factor", 1.0)),
            score_function=cfg.get("score_function", "softmax"),
        )
    raise ValueError(f"unsupported architecture {mt!r}")
