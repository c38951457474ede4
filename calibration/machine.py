"""This machine's facts for its hardware profile: RAM, what the OS holds, the cores and where
MLX computes, read when calibrate runs: from /proc on Linux, from sysconf and `vm_stat` on
macOS."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

GIB = 1 << 30


def machine_line() -> str:
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
            f"{mem / GIB:.1f} GiB RAM, python {platform.python_version()}")


def ram_gib() -> tuple[float, str]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / GIB, 2), "/proc/meminfo MemTotal"
    except OSError:
        pass
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return round(total / GIB, 2), "sysconf SC_PHYS_PAGES x SC_PAGE_SIZE"


def darwin_held(vm_stat: str) -> int:
    """Bytes the page cache cannot take on macOS, from `vm_stat`'s output: wired pages, the
    compressor's, and anonymous (app) memory less its purgeable part. What is left (free,
    file-backed, purgeable) is the kernel's to give to file pages."""
    size = re.search(r"page size of (\d+) bytes", vm_stat)
    pages = {m.group(1).strip().strip('"'): int(m.group(2))
             for m in re.finditer(r"^(.+?):\s+(\d+)\.?\s*$", vm_stat, re.M)}
    need = ("Pages wired down", "Pages occupied by compressor", "Anonymous pages",
            "Pages purgeable")
    if size is None or any(k not in pages for k in need):
        raise ValueError("vm_stat: not the output expected (page size, wired, compressor, "
                         "anonymous, purgeable)")
    return int(size.group(1)) * (pages["Pages wired down"] + pages["Pages occupied by compressor"]
                                 + max(pages["Anonymous pages"] - pages["Pages purgeable"], 0))


def os_reserve() -> tuple[float, str]:
    """What the OS and every other process hold now (GiB), and how it was read."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return _darwin_reserve()
    if "MemTotal" not in info or "MemAvailable" not in info:
        return 2.0, "assumption (no MemAvailable in /proc/meminfo): OS and other processes"
    held = (info["MemTotal"] - info["MemAvailable"]) / GIB
    return round(held, 2), (f"/proc/meminfo MemTotal - MemAvailable when calibrate ran "
                            f"({held:.2f} GiB, this process included): memory the OS and "
                            "other processes hold and will not give to the page cache")


def _darwin_reserve() -> tuple[float, str]:
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10,
                             check=True).stdout
        held = darwin_held(out) / GIB
    except (OSError, subprocess.SubprocessError, ValueError):
        return 2.0, "assumption (neither /proc/meminfo nor vm_stat): OS and other processes"
    return round(held, 2), (f"vm_stat when calibrate ran: wired + compressor + anonymous - "
                            f"purgeable pages ({held:.2f} GiB, this process included): memory "
                            "the OS and other processes hold and will not give to the page cache")


def host_cpu() -> dict[str, tuple[Any, str]]:
    """The cores threads share and whether compute runs on them (MLX's CPU backend)."""
    cores = os.cpu_count() or 1
    on_cpu = platform.system() != "Darwin"  # mlx[cpu] on Linux; Metal on macOS
    return {
        "cpu_cores": (cores, "os.cpu_count(): graph building, reader threads' copies and "
                      "faults" + (" and MLX's compute thread" if on_cpu else "") + " share them"),
        "compute_on_cpu": (on_cpu, "MLX's CPU backend (mlx[cpu], Linux): the compute thread "
                           "takes a core like any other" if on_cpu else "Metal: compute runs on "
                           "the GPU"),
    }


LRU_GEN = Path("/sys/kernel/mm/lru_gen/enabled")


def page_cache_policy(system: str | None = None, lru_gen: Path = LRU_GEN) -> tuple[str, str]:
    """Which bundles the kernel's page cache keeps (sim.page_cache.POLICIES), and why: Linux
    without multi-generational LRU keeps the active/inactive lists; with it (or elsewhere) the
    simulator has no model of the kernel's policy and keeps a plain LRU, saying so."""
    system = system or platform.system()
    if system != "Linux":
        return "lru", (f"{system}: the kernel's page-cache policy is not modelled; a plain LRU "
                       "stands for it")
    try:
        enabled = int(lru_gen.read_text().strip(), 16) != 0
    except (OSError, ValueError):
        enabled = False
    if enabled:
        return "lru", (f"{lru_gen} is on (multi-generational LRU), which the simulator does not "
                       "model: a plain LRU stands for it")
    return "linux-two-list", (f"Linux {platform.release()} without multi-generational LRU "
                              f"({lru_gen} absent or 0): the page cache keeps the active/"
                              "inactive lists with workingset detection (sim.two_list_lru); an "
                              "engine page-cache budget drops by recency itself (sim compare "
                              "uses lru for those traces)")


def facts(os_reserve_gib: float | None = None) -> dict[str, tuple[Any, str]]:
    """Hardware keys -> (value, how it was read): RAM, OS reserve (or `os_reserve_gib`, given),
    cores, whether compute runs on them, and the kernel's page-cache policy."""
    reserve, reserve_how = os_reserve()
    if os_reserve_gib is not None:
        reserve, reserve_how = os_reserve_gib, "given"
    return {"ram_gib": ram_gib(),
            "os_reserve_gib": (reserve, reserve_how), **host_cpu(),
            "page_cache_policy": page_cache_policy()}


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(caches: Path = CPU_CACHES, system: str | None = None) -> int | None:
    """The largest CPU cache the calibrating core sees, in bytes (None: not reported). Linux:
    sysfs's cache/index*/size of the highest level; macOS: sysctl's L3 size, else the
    performance cores' L2 (Apple's system-level cache is not reported)."""
    system = system or platform.system()
    if system == "Darwin":
        return _darwin_cache_bytes()
    best: tuple[int, int] | None = None
    for index in sorted(caches.glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            kind = (index / "type").read_text().strip()
        except (OSError, ValueError):
            continue
        match = re.fullmatch(r"(\d+)\s*([KMG]?)", size)
        if match is None or kind == "Instruction":
            continue
        found = (level, int(match.group(1)) * _UNITS[match.group(2)])
        best = found if best is None or found > best else best
    return best[1] if best else None


def _darwin_cache_bytes() -> int | None:
    for key in ("hw.l3cachesize", "hw.perflevel0.l2cachesize", "hw.l2cachesize"):
        try:
            out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True,
                                 timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if out.isdigit() and int(out) > 0:
            return int(out)
    return None
