"""The machine a search predicts for: a hardware profile plus an emulated machine's settings,
the same ones `ssdmoe capture` takes (cores, CPU quota, read throttle, the engine's page-cache
budget). They enter the simulator as the run.json record a capture under them writes
(run.json `extra`), so `sim compare` and advise read a machine the same way.

A machines file (scenarios/transfer/machines.toml's format, `[machines.NAME]` tables) names
machines; `page_cache_share` (a memory limit sized from a measured footprint) is validate's
and not taken here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.errors import BadInput, read_toml_table
from contract.thresholds import PAGE_CACHE_SHARES

KEYS = ("cpus", "cpu_quota", "page_cache", "read_mbps", "read_iops", "description")
BURST_S = 0.1  # the kernel's blk-throttle slice, as engine.machine_limits records it


@dataclass(frozen=True)
class Machine:
    name: str = "this machine"
    cpus: int | None = None
    cpu_quota: float | None = None
    page_cache_fraction: float | None = None  # the engine's page-cache budget, of expert bytes
    read_mbps: float | None = None
    read_iops: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        where = f"machine {self.name}"
        if self.cpus is not None and self.cpus < 1:
            raise BadInput(f"{where}: cpus {self.cpus}: expected >= 1")
        if self.cpu_quota is not None and not self.cpu_quota > 0:
            raise BadInput(f"{where}: cpu_quota {self.cpu_quota}: expected > 0")
        if self.page_cache_fraction is not None and not 0 < self.page_cache_fraction <= 1:
            raise BadInput(f"{where}: page cache {self.page_cache_fraction}: expected (0, 1]")
        for key in ("read_mbps", "read_iops"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise BadInput(f"{where}: {key} {value}: expected > 0")

    def run_extra(self) -> dict[str, Any]:
        """run.json `extra` as a capture on this machine records it (what sim compare reads)."""
        extra: dict[str, Any] = {}
        if self.read_mbps is not None or self.read_iops is not None:
            extra["throttle"] = {"read_mbps": self.read_mbps, "read_iops": self.read_iops,
                                 "burst_s": BURST_S}
        machine: dict[str, Any] = {}
        if self.cpus is not None:
            machine["cpuset"] = {"cores": list(range(self.cpus))}
        if self.cpu_quota is not None:
            machine["cpu_quota"] = {"cores": self.cpu_quota}
        if machine:
            extra["machine"] = machine
        return extra

    def page_cache_budget(self, expert_bytes: int) -> int | None:
        """The engine's page-cache budget in bytes, as `capture --page-cache-fraction` sets it."""
        if self.page_cache_fraction is None:
            return None
        return int(self.page_cache_fraction * expert_bytes)

    def flags(self) -> list[str]:
        """`ssdmoe capture` / `serve` flags that make this machine."""
        out: list[str] = []
        if self.cpus is not None:
            out += ["--cpus", str(self.cpus)]
        if self.cpu_quota is not None:
            out += ["--cpu-quota", f"{self.cpu_quota:g}"]
        if self.page_cache_fraction is not None:
            out += ["--page-cache-fraction", f"{self.page_cache_fraction:g}"]
        if self.read_mbps is not None:
            out += ["--read-mbps", f"{self.read_mbps:g}"]
        if self.read_iops is not None:
            out += ["--read-iops", str(self.read_iops)]
        return out

    def describe(self) -> str:
        parts = []
        if self.cpus is not None:
            parts.append(f"{self.cpus} core{'s' if self.cpus != 1 else ''}")
        if self.cpu_quota is not None:
            parts.append(f"CPU quota {self.cpu_quota:g}")
        if self.page_cache_fraction is not None:
            parts.append(f"page cache {self.page_cache_fraction:g} of the experts")
        if self.read_mbps is not None:
            parts.append(f"{self.read_mbps:g} MB/s")
        if self.read_iops is not None:
            parts.append(f"{self.read_iops} IOPS")
        return f"{self.name} ({', '.join(parts)})" if parts else self.name


def load_machine(path: Path, name: str) -> Machine:
    """Machine `name` of a machines file; one line naming the file and key for anything wrong."""
    data = read_toml_table(path)
    machines = data.get("machines")
    if not isinstance(machines, dict) or name not in machines:
        known = ", ".join(machines) if isinstance(machines, dict) else "none"
        raise BadInput(f"{path}: no machine {name!r} (machines: {known})")
    table = machines[name]
    where = f"{path}: machines.{name}"
    if not isinstance(table, dict):
        raise BadInput(f"{where}: expected a table")
    if "page_cache_share" in table:
        raise BadInput(f"{where}: page_cache_share (a memory limit sized from a measured "
                       "footprint) is validate's; advise takes page_cache = \"1/4\" (the "
                       "engine's budget)")
    bad = set(table) - set(KEYS)
    if bad:
        raise BadInput(f"{where}: unknown key {sorted(bad)[0]!r} (known: {', '.join(KEYS)})")
    kinds: dict[str, type] = {"cpus": int, "cpu_quota": float, "read_mbps": float,
                              "read_iops": int, "page_cache": str, "description": str}
    values: dict[str, Any] = {}
    for key, value in table.items():
        kind = kinds[key]
        ok = isinstance(value, kind) if kind is not float else isinstance(value, int | float)
        if not ok or isinstance(value, bool):
            raise BadInput(f"{where}: {key} {value!r}: expected {kind.__name__}")
        values[key] = kind(value)
    page_cache = values.pop("page_cache", "all")
    if page_cache not in PAGE_CACHE_SHARES:
        raise BadInput(f"{where}: page_cache {page_cache!r}: expected one of "
                       f"{', '.join(PAGE_CACHE_SHARES)}")
    return Machine(name=name, page_cache_fraction=PAGE_CACHE_SHARES[page_cache], **values)
