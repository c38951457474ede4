"""Engine configuration, one dataclass: which execution path runs each layer in each phase,
cache sizes, readers, I/O mode. Presets name the usual combinations; `to_dict()` is what a
trace's run.json records, and `from_dict()` is how the simulator reads it back (sim.compare).
Part of the contract engine and simulator share: no MLX, nothing of ours but contract.errors.

Paths: "exact" (on-demand, the correctness baseline), "hot" (shared byte-bounded LRU),
"staged" (fixed sticky slots, filled by reader threads), "whole-layer" (one large read per
tensor per layer, read ahead of compute; meant for prefill). The phase of a call is "prefill"
when it carries more than one token, else "decode" (the StreamingMoE rule). Every path computes the
same numbers, so any mix gives the same tokens."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from contract.errors import BadInput
from contract.eviction import DEFAULT as DEFAULT_POLICY
from contract.eviction import check_policy

PATHS = ("exact", "hot", "staged", "whole-layer")
# Paths that bring routed ids to the host while the graph is built (exact's synchronous
# loop): the decode loop looks ahead only when no decode layer runs one of these
# (engine.runtime.syncs_at_build, sim.compare.looked_ahead).
SYNC_AT_BUILD = frozenset({"exact"})
# How far ahead a staged layer's experts are known (architecture contract: lead kinds):
#   none   on demand: the layer's own router, read when it routes
#   token  one token ahead: the prerouter's heads (or the oracle replay) at token t give
#          layer N+1's set at t+1, staged while step t computes (the paper)
#   layer  same token, one layer ahead (Pre-gated MoE): layer N+1's own router applied to
#          layer N's post-attention state gives N+1's set, read while layer N's experts
#          compute; that prediction IS N+1's routing (engine.layer_lead)
LEADS = ("none", "token", "layer")
# The float dtype the engine computes in (engine.device): float32 on MLX's CPU backend and
# the checkpoint's own on Metal/CUDA ("auto"), or either one forced.
DTYPES = ("auto", "float32", "source")
PHASES = ("prefill", "decode")
HOT_FRACTION = 0.25  # default hot LRU budget: this fraction of all expert bytes
# Reads in flight (reader threads): the default is the model directory's calibrated queue
# depth (engine.queue_depth, written by `ssdmoe calibrate --model DIR`), else this.
DEFAULT_READERS = 2
MAX_READERS = 64  # more threads than any device queue worth filling from one process

PRESETS: dict[str, dict] = {
    "on-demand": {"prefill": "exact", "decode": "exact"},
    "hot": {"prefill": "whole-layer", "decode": "hot"},
    "staged": {"prefill": "whole-layer", "decode": "staged"},
}


@dataclass
class EngineConfig:
    preset: str = "custom"
    prefill: str = "exact"  # path of multi-token calls
    decode: str = "exact"  # path of single-token calls
    layers: dict[int, dict[str, str]] = field(default_factory=dict)  # {layer: {phase: path}}
    hot_bytes: int | None = None  # hot LRU budget in bytes; None: HOT_FRACTION of the experts
    staged_headroom: int | None = None  # staged slots = K + headroom; None: K (double buffer)
    readers: int | None = None  # reads in flight (reader threads); None: engine.queue_depth
    readers_source: str = ""  # where the reader count came from (set when it is resolved)
    help_reads: bool = True  # main thread does a needed read no reader has started yet
    # queued bundle reads on native threads (engine.native_reads: no interpreter lock on the
    # read path) where the pool can be built; else, and by default, on Python reader threads
    # (reports/io/native-reads: cold reads twice as fast, decode not faster on 2 cores)
    native_reads: bool = False
    readers_kind: str = ""  # who read them, set when resolved: "native" or "python: why"
    o_direct: bool = False
    page_cache_budget: int | None = None  # bytes of expert pages kept in the page cache
    # prerouter heads directory (`ssdmoe train heads`): at decode their predictions ARE the
    # routing of the consumer layers, staged one token ahead (engine.prerouter)
    prerouter: str | None = None
    # recovery LoRA adapter (`ssdmoe train sft` / `distill`): unmerged, on the resident
    # attention and shared-expert projections (engine.lora)
    lora: str | None = None
    # with prerouter heads: read the first MoE layer's likely experts from the step's token
    # before its router runs (engine.first_layer_hint; the table `train heads` fits)
    first_layer_hint: bool = False
    lead: int = 0  # tokens of staged lookahead (1 with a prerouter); 0 = fill on demand
    lead_kind: str = "none"  # LEADS; "token" whenever lead is 1
    top_k: int | None = None  # route at this K instead of the model's own (routing studies)
    dtype: str = "auto"  # DTYPES: float32 on the CPU backend, else the source's
    # eviction policy of every app cache (hot pool, staged slots, page-cache budget):
    # contract.eviction; None: the default (lru) where the config has a cache, none otherwise
    cache_policy: str | None = None
    lookahead: bool = True  # decode loop builds step t+1's graph while step t computes
    # (mlx-lm's generate_step does the same); in effect only when no decode layer syncs at
    # build (exact): see engine.generate

    def __post_init__(self) -> None:
        self.layers = {int(k): dict(v) for k, v in self.layers.items()}
        for where, p in [("prefill", self.prefill), ("decode", self.decode)] + [
                (f"layer {i} {ph}", p) for i, d in self.layers.items() for ph, p in d.items()]:
            if p not in PATHS:
                raise BadInput(f"engine config: {where} path {p!r} unknown "
                               f"(one of: {', '.join(PATHS)})")
        for i, d in self.layers.items():
            bad = set(d) - set(PHASES)
            if bad:
                raise BadInput(f"engine config: layer {i}: unknown phase {sorted(bad)[0]!r}")
        if self.readers is not None and not (
                isinstance(self.readers, int) and 1 <= self.readers <= MAX_READERS):
            raise BadInput(f"engine config: readers (--readers, reads in flight) must be an "
                           f"integer from 1 to {MAX_READERS}, got {self.readers!r}")
        if self.prerouter is False:  # run.json files written before the prerouter existed
            self.prerouter = None
        if self.prerouter is not None:
            self.prerouter = str(self.prerouter)
            self.lead = 1
        if self.lora is False:  # run.json's "no adapter"
            self.lora = None
        if self.lora is not None:
            self.lora = str(self.lora)
        if self.first_layer_hint and self.prerouter is None:
            raise BadInput("engine config: the first-layer hint (--first-layer-hint) comes "
                           "with prerouter heads (--prerouter DIR): its table is theirs")
        if self.lead not in (0, 1):
            raise BadInput(f"engine config: lead must be 0 or 1, got {self.lead}")
        if self.lead_kind not in LEADS:
            raise BadInput(f"engine config: lead {self.lead_kind!r} unknown "
                           f"(one of: {', '.join(LEADS)})")
        if self.lead_kind == "token" and self.prerouter is None and not self.lead:
            raise BadInput("engine config: lead 'token' needs prerouter heads (--prerouter DIR)")
        if self.lead == 1:
            if self.lead_kind == "layer":
                raise BadInput("engine config: lead 'layer' and prerouter heads (lead 'token') "
                               "exclude each other: give one")
            self.lead_kind = "token"
        if self.lead_kind == "layer" and self.decode != "staged":
            raise BadInput(f"engine config: lead 'layer' runs on the staged decode path "
                           f"(preset staged), not {self.decode!r}")
        if self.dtype not in DTYPES:
            raise BadInput(f"engine config: dtype {self.dtype!r} unknown (one of: "
                           f"{', '.join(DTYPES)})")
        if self.top_k is not None and self.top_k < 1:
            raise BadInput(f"engine config: K (--top-k) must be >= 1, got {self.top_k}")
        if self.staged_headroom is not None and self.staged_headroom < 0:
            raise BadInput(f"engine config: staged headroom must be >= 0, got "
                           f"{self.staged_headroom}")
        if self.cache_policy is not None:
            check_policy(self.cache_policy, "engine config: cache policy (--cache-policy)")
            if not self.has_cache():
                raise BadInput(f"engine config: cache policy {self.cache_policy!r} on a "
                               f"configuration with no cache (prefill {self.prefill}, decode "
                               f"{self.decode}, no page-cache budget): a policy needs the hot "
                               "or staged path, or --page-cache-budget")
        elif self.has_cache():
            self.cache_policy = DEFAULT_POLICY

    # ------------------------------------------------------------ construction

    @classmethod
    def from_preset(cls, name: str, **overrides) -> EngineConfig:
        if name not in PRESETS:
            raise BadInput(f"--preset {name!r}: unknown (one of: {', '.join(PRESETS)})")
        known = {f.name for f in fields(cls)}
        bad = set(overrides) - known
        if bad:
            raise TypeError(f"EngineConfig has no field {sorted(bad)[0]!r}")
        return cls(preset=name, **{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_run(cls, engine: dict) -> EngineConfig:
        """The config a trace's run.json `engine` records. Keys that older traces lack mean
        what the engine did before they existed: no `lookahead` is the synchronous loop."""
        return cls.from_dict({"lookahead": False, **engine})

    def with_(self, **changes) -> EngineConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = {str(k): v for k, v in sorted(self.layers.items())}
        return d

    # ------------------------------------------------------------ queries

    def has_cache(self) -> bool:
        """Does any app cache evict (the hot pool, staged slots, the page-cache budget)?"""
        paths = {self.prefill, self.decode} | {p for d in self.layers.values() for p in d.values()}
        return self.page_cache_budget is not None or bool(paths & {"hot", "staged"})

    def path_for(self, layer: int, phase: str) -> str:
        return self.layers.get(layer, {}).get(phase, self.prefill if phase == "prefill"
                                              else self.decode)

    def decode_paths(self, layers=()) -> set[str]:
        """The decode paths of `layers` (the default path when none are given)."""
        return {self.path_for(i, "decode") for i in layers} or {self.decode}

    def uses(self, path: str, layers) -> bool:
        return any(self.path_for(i, ph) == path for i in layers for ph in PHASES)

    def resolved_hot_bytes(self, expert_bytes: int) -> int:
        return self.hot_bytes if self.hot_bytes is not None else int(expert_bytes * HOT_FRACTION)

    def validate(self, manifest) -> None:
        """Budgets against the model: each must hold at least one layer's decode working set
        (K bundles). Raises BadInput naming the minimum."""
        need = manifest.top_k * manifest.bundle_bytes
        what = f"one layer's working set: K={manifest.top_k} bundles of " \
               f"{manifest.bundle_bytes} bytes = minimum {need} bytes"
        for i in self.layers:
            if i not in manifest.layers:
                raise BadInput(f"engine config: layer {i} is not a MoE layer of this model "
                               f"(MoE layers: {manifest.moe_layers})")
        if self.page_cache_budget is not None and self.page_cache_budget < need:
            raise BadInput(f"page-cache budget {self.page_cache_budget} bytes is smaller than "
                           f"{what}")
        expert_bytes = manifest.bundle_bytes * manifest.num_experts * len(manifest.layers)
        hot = self.resolved_hot_bytes(expert_bytes)
        if self.uses("hot", manifest.moe_layers) and hot < need:
            raise BadInput(f"hot LRU budget {hot} bytes is smaller than {what}")
        headroom = manifest.top_k if self.staged_headroom is None else self.staged_headroom
        if self.lead and self.uses("staged", manifest.moe_layers) and headroom < manifest.top_k:
            raise BadInput(f"staged headroom {headroom} is too small for lead {self.lead}: "
                           f"minimum {manifest.top_k} (K), so the next token's slots never "
                           "overwrite the current token's")
