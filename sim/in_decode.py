"""What `ssdmoe validate` fits inside decode (validation/decode_fits.py), as one typed record.

A scenario keeps the fits in its `[in_decode]` table, numbers keyed "figure" or
"figure.variant", each line's comment saying how it was fitted (`ssdmoe calibrate` writes the
starting values, `validate` refits them). `InDecode.from_table` checks every entry once (a
figure this record reads, a number; one line naming the scenario and the figure otherwise), and
`settings` says which profile keys a replay of a given engine configuration takes from them:
`sim compare` is the one reader. A scenario's `[notes]` holds text only (records such as
build_ms_per_layer.pure); a fit found there is refused with a line saying where it belongs."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.errors import BadInput

# fitted figures with one value: note key -> the profile key it sets
SINGLE = {
    "compute_factor": "compute_factor",
    "load_overhead_ms.in_decode": "load_overhead_ms",
    "handoff_ms.in_decode": "handoff_ms",
    "reader_wake_ms.in_decode": "reader_wake_ms",
    "ssd_latency_ms.in_decode": "ssd_latency_ms",
    "head_build_ms.in_decode": "head_build_ms",
    "cold_overhead_ms.in_decode": "cold_overhead_ms",
    "cold_overhead_ms.o_direct": "cold_overhead_ms",
    "budget_evict_ms.in_decode": "budget_evict_ms",
    "dispatch_cpu_ms_per_layer.in_decode": "dispatch_cpu_ms_per_layer",
}
# fitted per variant: note prefix -> the variants it is fitted for
PER_VARIANT = {
    "build_ms_per_layer": ("exact", "hot", "staged"),  # per decode path
    "fill_ms_per_layer": ("hot", "staged", "staged-layer"),  # per path (the layer lead's own)
    "cold_fill_compute_ms": ("in_decode", "sync"),  # per decode loop
}


def known_keys() -> list[str]:
    return [*SINGLE, *(f"{p}.{v}" for p, variants in PER_VARIANT.items() for v in variants)]


def check_notes(where: str, notes: dict[str, object]) -> None:
    """A scenario's [notes] hold text; a fitted figure there is refused (it would be unused)."""
    for key in notes:
        if is_fitted(key):
            raise BadInput(f"{where}: notes {key}: a fitted figure, which belongs in the "
                           "[in_decode] table as a number (move it there, or rerun `ssdmoe "
                           "calibrate`)")


def is_fitted(key: str) -> bool:
    """Whether `key` names a figure validate fits inside decode (and this record reads)."""
    prefix, _, variant = key.partition(".")
    return key in SINGLE or variant in PER_VARIANT.get(prefix, ())


@dataclass(frozen=True)
class InDecode:
    single: dict[str, float] = field(default_factory=dict)  # SINGLE's note keys
    per_variant: dict[str, dict[str, float]] = field(default_factory=dict)  # PER_VARIANT's

    @classmethod
    def from_table(cls, where: str, table: dict[str, object]) -> InDecode:
        for key, value in table.items():
            if not is_fitted(key):
                raise BadInput(f"{where}: in_decode {key}: not a figure `ssdmoe validate` fits "
                               f"(known: {', '.join(known_keys())})")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BadInput(f"{where}: in_decode {key}: {value!r} is not a number (a figure "
                               "`ssdmoe validate` fitted)")
        single = {k: float(table[k]) for k in SINGLE if k in table}
        per = {p: {v: float(table[f"{p}.{v}"]) for v in variants if f"{p}.{v}" in table}
               for p, variants in PER_VARIANT.items()}
        return cls(single, per)

    def fill(self, path: str, lead: str | None) -> float | None:
        """The lookahead loop's hand-over per layer; the layer lead has its own (profiles
        fitted before it had one: the staged path's)."""
        fills = self.per_variant.get("fill_ms_per_layer", {})
        if lead == "layer" and "staged-layer" in fills:
            return fills["staged-layer"]
        return fills.get(path)

    def settings(self, path: str, lead: str | None, lookahead: bool, prerouter: bool,
                 o_direct: bool) -> list[tuple[str, float]]:
        """(profile key, value) for a replay of the engine configuration: what was fitted for
        its decode path and loop, and nothing that was not fitted."""
        out: list[tuple[str, float]] = []
        build = self.per_variant.get("build_ms_per_layer", {}).get(path)
        if build is not None:
            out.append(("build_ms_per_layer", build))
        fill = self.fill(path, lead)
        if fill is not None:
            out.append(("fill_ms_per_layer", fill))
        keys = ["compute_factor", "load_overhead_ms.in_decode", "handoff_ms.in_decode",
                "reader_wake_ms.in_decode", "ssd_latency_ms.in_decode",
                "dispatch_cpu_ms_per_layer.in_decode"]
        if prerouter:
            keys.append("head_build_ms.in_decode")
        keys.append("cold_overhead_ms.o_direct" if o_direct else "cold_overhead_ms.in_decode")
        out += [(SINGLE[k], self.single[k]) for k in keys if k in self.single]
        loop = self.per_variant.get("cold_fill_compute_ms", {}).get(
            "in_decode" if lookahead else "sync")
        if loop is not None:
            out.append(("cold_fill_compute_ms", loop))
        return out

    @property
    def budget_evict_ms(self) -> float | None:
        return self.single.get("budget_evict_ms.in_decode")
