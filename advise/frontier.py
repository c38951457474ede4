"""From simulated candidates to advice: which are allowed, the frontier per K, one
recommendation, and the resource that binds it.

Frontier: for each K, the candidates no other candidate of that K beats on both the objective
(decode or prefill tok/s) and the engine's memory. Recommendation: the best allowed objective;
among the allowed candidates within TIE of it (closer than the simulator can tell apart) the
one with the least engine memory."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from advise.space import Candidate

TIE = 0.01  # objective within 1% of the best: the cheaper in memory is recommended
OBJECTIVES = {"decode": "decode_tok_s", "prefill": "prefill_tok_s"}
IO_SHARE = 0.3  # blocked on loads for this share of a step or more: I/O binds
BUSY = 0.6  # ... and the device busy this share of the time or more: bandwidth, else per-IO


@dataclass
class Constraints:
    max_engine_bytes: int | None = None
    min_top1: float | None = None  # agreement with the teacher (ssdmoe eval)

    def why_not(self, row: dict[str, Any], quality: dict[str, Any] | None) -> str | None:
        if row.get("status") != "ok":
            return f"simulation failed: {row.get('error')}"
        if self.max_engine_bytes is not None and row["peak_engine_bytes"] > self.max_engine_bytes:
            return "memory"
        if self.min_top1 is not None:
            if quality is None:
                return "quality (no ssdmoe eval row at this K)"
            if quality["top1"] < self.min_top1:
                return "quality"
        return None


@dataclass
class Entry:
    candidate: Candidate
    row: dict[str, Any]
    quality: dict[str, Any] | None = None
    excluded: str | None = None  # the constraint it breaks
    frontier: bool = False

    def value(self, objective: str) -> float:
        v = self.row.get(OBJECTIVES[objective]) if self.row.get("status") == "ok" else None
        return float(v) if v is not None and math.isfinite(v) else -math.inf

    @property
    def engine_bytes(self) -> float:
        return float(self.row.get("peak_engine_bytes") or math.inf)

    def as_dict(self) -> dict[str, Any]:
        keep = ("status", "error", "decode_tok_s", "prefill_tok_s", "blocked_ms_per_step",
                "build_ms_per_step", "eval_ms_per_step", "loads_per_step", "cold_fraction",
                "cache_hit_rate", "device_busy_fraction", "peak_engine_bytes",
                "page_cache_bytes", "main_cpu_ms_per_step", "warnings")
        return {**self.candidate.as_dict(), "label": self.candidate.label,
                "predicted": {k: self.row.get(k) for k in keep}, "quality": self.quality,
                "excluded": self.excluded, "frontier": self.frontier}


@dataclass
class Advice:
    objective: str
    entries: list[Entry]
    recommended: Entry | None
    reason: str
    per_k: dict[int, list[Entry]] = field(default_factory=dict)


def mark_frontier(entries: list[Entry], objective: str) -> None:
    """Per K: allowed entries that no allowed entry of the same K beats on both axes."""
    allowed = [e for e in entries if e.excluded is None]
    for e in allowed:
        e.frontier = not any(
            o is not e and o.candidate.k == e.candidate.k
            and o.value(objective) >= e.value(objective) and o.engine_bytes <= e.engine_bytes
            and (o.value(objective) > e.value(objective) or o.engine_bytes < e.engine_bytes)
            for o in allowed)


def binding(e: Entry, read_mbps: float | None = None) -> str:
    """The resource that limits a candidate's decode, from its simulated step. `read_mbps`: a
    read throttle (the device behind it may idle while the throttle binds)."""
    r = e.row
    step = 1000.0 / r["decode_tok_s"] if r.get("decode_tok_s") else math.nan
    blocked = r.get("blocked_ms_per_step") or 0.0
    build = r.get("build_ms_per_step") or 0.0
    compute = r.get("eval_ms_per_step") or 0.0
    busy = r.get("device_busy_fraction") or 0.0
    if blocked >= IO_SHARE * step:
        cold_mb = (r.get("mib_per_step") or 0.0) * (r.get("cold_fraction") or 0.0) * 2**20 / 1e6
        used = cold_mb / (step / 1000.0)
        if read_mbps and used >= BUSY * read_mbps:
            return (f"bandwidth: cold reads use {used:.0f} of the {read_mbps:g} MB/s read "
                    f"throttle and the step waits {blocked:.1f} of {step:.1f} ms on loads")
        if busy >= BUSY:
            return (f"bandwidth: the storage device is busy {busy:.0%} of the time and the "
                    f"step waits {blocked:.1f} of {step:.1f} ms on loads")
        return (f"per-IO cost: the step waits {blocked:.1f} of {step:.1f} ms on "
                f"{r.get('loads_per_step', 0):.1f} loads while the device is busy only "
                f"{busy:.0%} of the time")
    if build > compute:
        return (f"CPU: graph building and dispatch on the main thread take {build:.1f} of "
                f"{step:.1f} ms per step")
    return f"compute: the model's kernels take {compute:.1f} of {step:.1f} ms per step"


def advise(entries: list[Entry], objective: str, constraints: Constraints,
           read_mbps: float | None = None) -> Advice:
    for e in entries:
        e.excluded = constraints.why_not(e.row, e.quality)
    mark_frontier(entries, objective)
    allowed = [e for e in entries if e.excluded is None and e.value(objective) > -math.inf]
    per_k: dict[int, list[Entry]] = {}
    for e in sorted(allowed, key=lambda e: -e.value(objective)):
        per_k.setdefault(e.candidate.k, []).append(e)
    if not allowed:
        return Advice(objective, entries, None, _none_reason(entries, constraints), per_k)
    top = max(e.value(objective) for e in allowed)
    near = [e for e in allowed if e.value(objective) >= (1 - TIE) * top]
    rec = min(near, key=lambda e: (e.engine_bytes, -e.value(objective)))
    reason = binding(rec, read_mbps)
    blocked_by_memory = [e for e in entries if e.excluded == "memory"
                         and e.value(objective) > rec.value(objective) * (1 + TIE)]
    if blocked_by_memory:
        faster = max(blocked_by_memory, key=lambda e: e.value(objective))
        reason = (f"memory: {faster.candidate.label} would reach "
                  f"{faster.value(objective):.1f} tok/s but needs "
                  f"{faster.engine_bytes / 2**20:.0f} MiB, over the ceiling of "
                  f"{constraints.max_engine_bytes / 2**20:.0f} MiB; within it, {reason}")
    return Advice(objective, entries, rec, reason, per_k)


def _none_reason(entries: list[Entry], constraints: Constraints) -> str:
    """Why nothing is allowed: the constraint that binds, with the nearest miss."""
    ok = [e for e in entries if e.row.get("status") == "ok"]
    if not ok:
        first = next((e.row.get("error") for e in entries), "no candidates")
        return f"every candidate's simulation failed (first: {first})"
    if constraints.max_engine_bytes is not None and all(e.excluded == "memory" for e in ok):
        least = min(ok, key=lambda e: e.engine_bytes)
        return (f"--max-memory {constraints.max_engine_bytes / 2**20:.0f} MiB binds: the "
                f"smallest engine allocation is {least.engine_bytes / 2**20:.1f} MiB "
                f"({least.candidate.label})")
    rated = [e for e in ok if e.quality is not None]
    if not rated:
        return "--min-top1 binds: no K searched has an ssdmoe eval row (run ssdmoe eval)"
    best = max(rated, key=lambda e: e.quality["top1"])
    return (f"--min-top1 {constraints.min_top1:g} binds: the best top-1 agreement is "
            f"{best.quality['top1']:.3f} ({best.candidate.label})")
