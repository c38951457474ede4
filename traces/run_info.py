"""What goes in run.json besides the model and engine config: machine and package facts."""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from traces.schema import SCHEMA_VERSION

PACKAGES = ("mlx", "mlx-lm", "numpy", "polars", "simpy", "ssdmoe")


@dataclass
class RunInfo:
    model: dict[str, Any]  # name, architecture, layers, experts, k, bundle_bytes, manifest_sha256
    engine: dict[str, Any]  # paths, k, cache budgets, page-cache budget, o_direct, prerouter, lora
    kind: str = "measured"  # "measured" (engine) or "simulated" (sim)
    machine: dict[str, Any] = field(default_factory=lambda: machine_info())
    packages: dict[str, str] = field(default_factory=lambda: package_versions())
    command: list[str] = field(default_factory=lambda: list(sys.argv))
    started_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    schema_version: int = SCHEMA_VERSION
    complete: bool = False  # set True only by a clean close; a killed run stays False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _mem_total_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return -1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def disk_of(path: str | Path = ".") -> dict[str, str]:
    """Block device and filesystem holding `path` (Linux: /proc/mounts, longest matching prefix)."""
    target = str(Path(path).resolve())
    best = ("", "unknown", "unknown")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if target.startswith(mount) and len(mount) > len(best[0]):
                    best = (mount, device, fstype)
    except OSError:
        pass
    return {"mount": best[0], "device": best[1], "filesystem": best[2]}


def machine_info(data_path: str | Path = ".") -> dict[str, Any]:
    return {
        "os": f"{platform.system()} {platform.release()}",
        "cpu": _cpu_name(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "ram_bytes": _mem_total_bytes(),
        **disk_of(data_path),
    }
