"""An emulated machine on real hardware: the kernel's control groups make this process see less
memory, fewer cores, less CPU time and slower storage than the machine has.

    limits = MachineLimits.parse(mem_limit="700M", cpus=1, cpu_quota=None, read_mbps="100")
    with EmulatedMachine(model_dir, limits) as m:      # Linux, root
        ...run the engine...
        run_json["machine"] = m.record()

  --mem-limit SIZE   memory.limit_in_bytes (v1) / memory.max (v2): what this process and the
                     page cache it reads through may hold together. The group is made when the
                     limit is entered, so it is charged for what the process allocates and reads
                     from then on; what the process already holds is charged elsewhere, so the
                     group's limit is SIZE less that (its anonymous resident bytes, measured).
                     The model's files leave the page cache on entry: the emulated machine
                     starts cold and every page it reads is charged to it. The kernel reclaims
                     the group's page cache under its limit, as a machine with that RAM would.
  --cpus N           cpuset.cpus: the first N cores this process may run on; every thread,
                     those started later included, runs on them.
  --cpu-quota F      cpu.cfs_quota_us / cpu.cfs_period_us (v1), cpu.max (v2): F cores' worth of
                     CPU time per 100 ms period (the kernel's CFS bandwidth control: threads run
                     at full speed until the period's quota is spent, then wait for the next).
  --read-mbps/-iops  the block-I/O read throttle (engine.throttle).

Each setting is recorded in run.json (`machine`), and removed on exit, error and Ctrl-C
(engine.cgroups). No MLX here."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import BadInput
from engine.cgroups import (
    ROOT,
    CgroupUnavailable,
    ProcessGroups,
    check_controllers,
    current_group,
    hierarchy,
)
from engine.throttle import BURST_S, ThrottleSpec, block_device, throttle_settings

MIB = 2**20
CFS_PERIOD_US = 100_000  # the kernel's default CFS bandwidth period
# The least room a memory limit must leave beyond the process's own memory: its reads go through
# the page cache, and the kernel needs a few pages to read through at all. Less than one step's
# bundles is allowed (that is a machine that thrashes, which is worth measuring).
MIN_PAGE_CACHE = 4 * MIB
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": MIB, "mib": MIB, "g": 2**30,
          "gib": 2**30}


def parse_size(text: str, flag: str = "--mem-limit") -> int:
    """'700M', '1.5G', '734003200' (binary units: M = MiB) -> bytes; one line if it is not."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise BadInput(f"{flag} {text!r}: not a size (bytes, or a number with K, M or G: "
                       "700M, 1.5G)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise BadInput(f"{flag} {text!r}: must be > 0")
    return size


def available_cpus() -> list[int]:
    """The cores this process may run on now."""
    return sorted(os.sched_getaffinity(0))


@dataclass(frozen=True)
class MachineLimits:
    mem_limit: int | None = None  # bytes: the process and its page cache together
    cpus: int | None = None  # cores to run on
    cpu_quota: float | None = None  # cores' worth of CPU time
    throttle: ThrottleSpec = field(default_factory=ThrottleSpec)

    def __post_init__(self) -> None:
        have = len(available_cpus())
        if self.mem_limit is not None and self.mem_limit <= 0:
            raise BadInput(f"--mem-limit: must be > 0, got {self.mem_limit}")
        if self.cpus is not None and not 1 <= self.cpus <= have:
            raise BadInput(f"--cpus {self.cpus}: this machine has {have} core"
                           f"{'s' if have != 1 else ''} to run on (give 1-{have})")
        cores = self.cpus or have
        if self.cpu_quota is not None and not 0 < self.cpu_quota <= cores:
            raise BadInput(f"--cpu-quota {self.cpu_quota:g}: must be > 0 and at most the "
                           f"{cores} core{'s' if cores != 1 else ''} it runs on")

    @classmethod
    def parse(cls, mem_limit: str | None = None, cpus: int | None = None,
              cpu_quota: str | float | None = None, read_mbps: str | None = None,
              read_iops: str | None = None) -> MachineLimits:
        """From command-line text: one clear line for each value that is not valid."""
        quota = None
        if cpu_quota is not None:
            try:
                quota = float(cpu_quota)
            except ValueError:
                raise BadInput(f"--cpu-quota {cpu_quota!r}: not a number (cores' worth of CPU "
                               "time: 0.5, 1.5)") from None
        return cls(mem_limit=None if mem_limit is None else parse_size(mem_limit),
                   cpus=cpus, cpu_quota=quota,
                   throttle=ThrottleSpec.parse(read_mbps, read_iops))

    @property
    def controllers(self) -> list[str]:
        return ([*(["memory"] if self.mem_limit is not None else []),
                 *(["cpuset"] if self.cpus is not None else []),
                 *(["cpu"] if self.cpu_quota is not None else []),
                 *(["io"] if self.throttle.active else [])])

    @property
    def active(self) -> bool:
        return bool(self.controllers)

    def flags(self) -> list[str]:
        """The same limits as command-line flags (for a child `ssdmoe` process)."""
        out = []
        if self.mem_limit is not None:
            out += ["--mem-limit", str(self.mem_limit)]
        if self.cpus is not None:
            out += ["--cpus", str(self.cpus)]
        if self.cpu_quota is not None:
            out += ["--cpu-quota", f"{self.cpu_quota:g}"]
        if self.throttle.read_mbps is not None:
            out += ["--read-mbps", f"{self.throttle.read_mbps:g}"]
        if self.throttle.read_iops is not None:
            out += ["--read-iops", str(self.throttle.read_iops)]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mem_limit": self.mem_limit, "cpus": self.cpus, "cpu_quota": self.cpu_quota,
                "read_mbps": self.throttle.read_mbps, "read_iops": self.throttle.read_iops}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MachineLimits:
        return cls(mem_limit=d.get("mem_limit"), cpus=d.get("cpus"),
                   cpu_quota=d.get("cpu_quota"),
                   throttle=ThrottleSpec(d.get("read_mbps"), d.get("read_iops")))


def check_available(limits: MachineLimits) -> None:
    """Raise CgroupUnavailable (one line) when `limits` cannot be set on this machine."""
    if limits.active:
        what = "/".join(f for f in limits.flags() if f.startswith("--"))
        check_controllers(limits.controllers, what)


def anonymous_bytes() -> int:
    """This process's anonymous resident bytes (RssAnon): its own memory, not file pages."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def drop_model_pages(model_dir: Path) -> int:
    """Drop the model's files from the page cache (POSIX_FADV_DONTNEED); returns files dropped."""
    n = 0
    for f in sorted(Path(model_dir).rglob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def _mems(where: Path) -> str:
    """The memory nodes a new v1 cpuset must name: its parent's (the process's own group)."""
    home = where / current_group("v1", where).lstrip("/")
    return ((home if (home / "cpuset.mems").exists() else where) / "cpuset.mems").read_text() \
        .strip()


class EmulatedMachine:
    """Context manager: this process (threads and children) under `limits`. `to_load` is what
    the process will still allocate for the model (its resident bytes, when entered before
    loading): a memory limit must leave room for it."""

    def __init__(self, model_dir: Path, limits: MachineLimits, to_load: int = 0,
                 root: Path = ROOT):
        self.model_dir, self.limits, self.to_load, self.root = Path(model_dir), limits, \
            to_load, root
        self.groups: ProcessGroups | None = None
        self.own_bytes = 0
        self.cores: list[int] = []
        self.device = ""

    def settings(self) -> dict[str, list[tuple[str, str]]]:
        lim, out = self.limits, {}
        if lim.mem_limit is not None:
            self.own_bytes = anonymous_bytes()
            need = self.own_bytes + self.to_load + MIN_PAGE_CACHE
            if lim.mem_limit < need:
                raise BadInput(
                    f"--mem-limit {lim.mem_limit / MIB:.0f} MiB: below what this process "
                    f"needs: {self.own_bytes / MIB:.0f} MiB of its own memory"
                    + (f", {self.to_load / MIB:.0f} MiB of {self.model_dir} still to load"
                       if self.to_load else "")
                    + f" and {MIN_PAGE_CACHE // MIB} MiB of page cache to read through; "
                    f"give at least {need / MIB:.0f} MiB")
            version, _ = hierarchy("memory", self.root)
            name = "memory.limit_in_bytes" if version == "v1" else "memory.max"
            out["memory"] = [(name, str(lim.mem_limit - self.own_bytes))]
        if lim.cpus is not None:
            self.cores = available_cpus()[:lim.cpus]
            version, where = hierarchy("cpuset", self.root)
            cores = ",".join(map(str, self.cores))
            out["cpuset"] = ([("cpuset.mems", _mems(where))] if version == "v1"
                             else []) + [("cpuset.cpus", cores)]
        if lim.cpu_quota is not None:
            quota = int(round(lim.cpu_quota * CFS_PERIOD_US))
            version, _ = hierarchy("cpu", self.root)
            out["cpu"] = ([("cpu.cfs_period_us", str(CFS_PERIOD_US)),
                           ("cpu.cfs_quota_us", str(quota))] if version == "v1"
                          else [("cpu.max", f"{quota} {CFS_PERIOD_US}")])
        if lim.throttle.active:
            self.device = block_device(self.model_dir)
            version, _ = hierarchy("io", self.root)
            out["io"] = throttle_settings(lim.throttle, self.device, version)
        return out

    def __enter__(self) -> EmulatedMachine:
        if not self.limits.active:
            return self
        if self.root == ROOT:
            check_available(self.limits)
        self.groups = ProcessGroups(self.settings(), root=self.root,
                                    what=" ".join(self.limits.flags()))
        self.groups.__enter__()
        if self.limits.mem_limit is not None:
            drop_model_pages(self.model_dir)  # start cold: every page read is charged here
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def leave(self) -> None:
        if self.groups is not None:
            self.groups.leave()

    def record(self) -> dict[str, Any] | None:
        """run.json `machine`: what was set, measured and how (None when nothing was)."""
        if not self.limits.active or self.groups is None:
            return None
        lim, g = self.limits, self.groups
        out: dict[str, Any] = {"limits": lim.to_dict()}
        if lim.mem_limit is not None:
            out["memory"] = {"limit_bytes": lim.mem_limit, "own_bytes_at_entry": self.own_bytes,
                             "group_limit_bytes": lim.mem_limit - self.own_bytes,
                             "mechanism": g.mechanism("memory")}
        if lim.cpus is not None:
            out["cpuset"] = {"cores": self.cores, "mechanism": g.mechanism("cpuset")}
        if lim.cpu_quota is not None:
            out["cpu_quota"] = {"cores": lim.cpu_quota, "period_us": CFS_PERIOD_US,
                                "mechanism": g.mechanism("cpu")}
        if lim.throttle.active:
            out["throttle"] = self.throttle_record()
        return out

    def exit_figures(self) -> dict[str, int]:
        """Measured at the end of a run under a memory limit: the process's own memory then
        (what it allocated inside the group came out of the page cache's room) and the group's
        peak charge (the kernel's memory.max_usage_in_bytes; v1 only)."""
        if self.limits.mem_limit is None or self.groups is None:
            return {}
        out = {"own_bytes_at_exit": anonymous_bytes()}
        for _version, _where, group, _home in self.groups.entered:
            peak = group / "memory.max_usage_in_bytes"
            if peak.exists():
                out["group_peak_bytes"] = int(peak.read_text())
        return out

    def throttle_record(self) -> dict[str, Any] | None:
        """run.json `throttle`: what was set, where and how (None: unthrottled)."""
        spec = self.limits.throttle
        if not spec.active or self.groups is None:
            return None
        v1 = self.groups.versions.get("io") == "v1"
        return {"read_mbps": spec.read_mbps, "read_bps": spec.read_bps,
                "read_iops": spec.read_iops, "device": self.device,
                "mechanism": "cgroup v1 blkio.throttle" if v1 else "cgroup v2 io.max",
                "burst_s": BURST_S}


def describe(limits: MachineLimits) -> str:
    """One line for logs: 'mem 700 MiB, 1 core, quota 0.5, 100 MB/s' (or 'this machine')."""
    parts = []
    if limits.mem_limit is not None:
        parts.append(f"mem {limits.mem_limit / MIB:.0f} MiB")
    if limits.cpus is not None:
        parts.append(f"{limits.cpus} core{'s' if limits.cpus != 1 else ''}")
    if limits.cpu_quota is not None:
        parts.append(f"quota {limits.cpu_quota:g}")
    if limits.throttle.read_mbps is not None:
        parts.append(f"{limits.throttle.read_mbps:g} MB/s")
    if limits.throttle.read_iops is not None:
        parts.append(f"{limits.throttle.read_iops} IOPS")
    return ", ".join(parts) or "this machine"


__all__ = ["CgroupUnavailable", "EmulatedMachine", "MachineLimits", "check_available",
           "describe", "parse_size"]
