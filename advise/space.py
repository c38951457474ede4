"""The configuration space: a candidate is one way to run the model, in the engine's words.

Arms (contract.engine_config): on-demand (the exact path, every routed expert read on the main
thread, the engine's default preset), hot (a shared LRU pool of bundles), staged (K + headroom
slots per layer filled by reader threads, routed on demand), staged-layer (the next layer's
router on this layer's state: same token, one layer ahead) and staged-token (the prerouter's
heads: one token ahead; only at a K the model has heads for).

Axes per arm: K for every arm; the hot pool's size (a share of the expert bytes) for hot; the
staged headroom (slots beyond K) for the staged arms; reads in flight for every arm but
on-demand; the cache policy wherever something evicts (contract.eviction)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from contract.engine_config import EngineConfig
from contract.errors import BadInput
from contract.eviction import ENGINE_POLICIES

ARMS = ("on-demand", "hot", "staged", "staged-layer", "staged-token")
HOT_FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)
READERS = (1, 2, 4, 6)
# staged headroom as multiples of K (the engine's default is K: room to stage the next call's
# set while the last call's is in use)
HEADROOM_OF_K = (0.5, 1.0, 2.0)
LEAD_ARMS = ("staged-layer", "staged-token")  # a lead needs headroom >= K (EngineConfig.validate)
AXES = ("hot_fraction", "headroom", "readers", "cache_policy")


@dataclass(frozen=True)
class Candidate:
    arm: str
    k: int
    hot_fraction: float | None = None  # hot: the pool as a share of the expert bytes
    headroom: int | None = None  # staged arms: slots per layer beyond K
    readers: int | None = None  # every arm but on-demand: reads in flight
    cache_policy: str | None = None  # wherever something evicts

    @property
    def label(self) -> str:
        return ", ".join([self.arm, f"K={self.k}", *self.settings])

    @property
    def settings(self) -> list[str]:
        """The axes beyond arm and K, in words ([] for plain on-demand)."""
        parts = []
        if self.hot_fraction is not None:
            parts.append(f"hot {self.hot_fraction:g}")
        if self.headroom is not None:
            parts.append(f"headroom {self.headroom}")
        if self.readers is not None:
            parts.append(f"readers {self.readers}")
        if self.cache_policy is not None:
            parts.append(self.cache_policy)
        return parts

    def as_dict(self) -> dict[str, Any]:
        return {"arm": self.arm, "k": self.k, "hot_fraction": self.hot_fraction,
                "headroom": self.headroom, "readers": self.readers,
                "cache_policy": self.cache_policy}

    def engine_config(self, expert_bytes: int, heads: str | None,
                      page_cache_budget: int | None) -> EngineConfig:
        """The engine configuration this candidate is (what a capture of it records)."""
        preset = {"on-demand": "on-demand", "hot": "hot"}.get(self.arm, "staged")
        lead = {"staged-layer": "layer", "staged-token": "token"}.get(self.arm, "none")
        return EngineConfig.from_preset(
            preset, top_k=self.k, readers=self.readers, cache_policy=self.cache_policy,
            lead_kind=lead, prerouter=heads if lead == "token" else None,
            hot_bytes=None if self.hot_fraction is None else int(self.hot_fraction
                                                                 * expert_bytes),
            staged_headroom=self.headroom, page_cache_budget=page_cache_budget)

    def capture_flags(self, heads: str | None, bundle_bytes: int, expert_bytes: int) -> list[str]:
        """`ssdmoe capture` / `serve` flags for this candidate."""
        preset = {"on-demand": "on-demand", "hot": "hot"}.get(self.arm, "staged")
        out = ["--preset", preset, "--top-k", str(self.k)]
        if self.arm == "staged-layer":
            out += ["--lead", "layer"]
        if self.arm == "staged-token":
            out += ["--prerouter", str(heads)]
        if self.hot_fraction is not None:
            mib = max(self.hot_fraction * expert_bytes, bundle_bytes) / 2**20
            out += ["--hot-mb", f"{mib:.6g}"]
        if self.headroom is not None:
            out += ["--staged-headroom", str(self.headroom)]
        if self.readers is not None:
            out += ["--readers", str(self.readers)]
        if self.cache_policy is not None:
            out += ["--cache-policy", self.cache_policy]
        return out


@dataclass
class Space:
    """What to search: arms, K values and each axis's values."""

    arms: list[str]
    ks: list[int]
    heads_k: set[int]  # K with prerouter heads (staged-token runs only there)
    default_readers: int
    hot_fractions: list[float] = field(default_factory=lambda: list(HOT_FRACTIONS))
    readers: list[int] = field(default_factory=lambda: list(READERS))
    headroom_of_k: list[float] = field(default_factory=lambda: list(HEADROOM_OF_K))
    policies: list[str] = field(default_factory=lambda: list(ENGINE_POLICIES))
    page_cache_budget: bool = False  # the machine's page-cache budget evicts on every arm

    def lines(self) -> list[tuple[str, int]]:
        """(arm, K) pairs the space holds: staged-token only where heads exist."""
        return [(arm, k) for arm in self.arms for k in self.ks
                if arm != "staged-token" or k in self.heads_k]

    def axes(self, arm: str, k: int) -> dict[str, list[Any]]:
        """The values of each axis this arm has."""
        out: dict[str, list[Any]] = {}
        if arm == "hot":
            out["hot_fraction"] = list(self.hot_fractions)
        if arm.startswith("staged"):
            least = k if arm in LEAD_ARMS else 0  # the next token's slots never overwrite these
            out["headroom"] = sorted({h for f in self.headroom_of_k
                                      if (h := max(0, int(round(f * k)))) >= least}) or [least]
        if arm != "on-demand":
            out["readers"] = list(self.readers)
        if arm != "on-demand" or self.page_cache_budget:
            out["cache_policy"] = list(self.policies)
        return out

    def default(self, arm: str, k: int) -> Candidate:
        """The engine's own defaults for this arm (the search's starting point)."""
        axes = self.axes(arm, k)
        return Candidate(
            arm=arm, k=k,
            hot_fraction=0.25 if "hot_fraction" in axes else None,
            headroom=k if "headroom" in axes else None,
            readers=self.default_readers if "readers" in axes else None,
            cache_policy="lru" if "cache_policy" in axes else None)

    def every(self, arm: str, k: int) -> list[Candidate]:
        axes = self.axes(arm, k)
        names = list(axes)
        return [replace(self.default(arm, k), **dict(zip(names, combo, strict=True)))
                for combo in itertools.product(*(axes[n] for n in names))]

    def size(self) -> int:
        return sum(len(self.every(arm, k)) for arm, k in self.lines())


def check_arms(arms: list[str]) -> list[str]:
    for arm in arms:
        if arm not in ARMS:
            raise BadInput(f"--arms: {arm!r} unknown (one of {', '.join(ARMS)})")
    return arms
