"""Emulated storage speed on real hardware: the kernel's block-I/O throttle on the device that
holds the model, applied to this process (its threads and children inherit it). This module
says what to set; engine.machine_limits.EmulatedMachine sets it, beside the other limits:

    limits = MachineLimits(throttle=ThrottleSpec(read_mbps=50))
    with EmulatedMachine(model_dir, limits) as m:    # reads from that disk <= 50 MB/s
        ...run the engine...
        run_json["throttle"] = m.throttle_record()

Linux only, as root. Two hierarchies:
  cgroup v1  /sys/fs/cgroup/blkio/<group>/blkio.throttle.read_bps_device ("MAJ:MIN BYTES"),
             read_iops_device likewise;
  cgroup v2  <unified>/<group>/io.max ("MAJ:MIN rbps=BYTES riops=N"), where the io controller
             is enabled for the parent's children.
The throttle is not a slow pipe: both are the kernel's blk-throttle, which grants a whole
slice's bytes (throtl_slice, 100 ms) at the slice's start, so reads pass at full speed until
the slice's allowance is spent and then wait for the next slice. `BURST_S` is that slice; the
simulator models the same mechanism (sim.token_bucket.SliceThrottle).

Setting up moves this process into a fresh cgroup (engine.cgroups); leaving moves it back and
removes the group, on normal exit, on an exception (Ctrl-C included) and at interpreter exit.
Rates are decimal: 1 MB/s = 10^6 bytes/s (as `ssd_bandwidth_gbps` is 10^9 bytes/s).
No MLX here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from contract.errors import BadInput
from engine.cgroups import CgroupUnavailable, check_controllers

BURST_S = 0.1  # v1 blk-throttle's slice (throtl_slice = HZ/10): what passes at full speed
MB = 10**6


class ThrottleUnavailable(CgroupUnavailable):
    """The throttle cannot be set on this machine (one line saying why)."""


@dataclass(frozen=True)
class ThrottleSpec:
    read_mbps: float | None = None
    read_iops: int | None = None

    def __post_init__(self) -> None:
        if self.read_mbps is not None and not self.read_mbps > 0:
            raise BadInput(f"--read-mbps: must be > 0, got {self.read_mbps}")
        if self.read_iops is not None and not self.read_iops > 0:
            raise BadInput(f"--read-iops: must be > 0, got {self.read_iops}")

    @classmethod
    def parse(cls, read_mbps: str | None, read_iops: str | None) -> ThrottleSpec:
        """From command-line text: one clear line for what is not a positive number."""
        def number(text: str | None, flag: str, kind: type) -> float | int | None:
            if text is None:
                return None
            try:
                return kind(text)
            except ValueError:
                raise BadInput(f"{flag} {text!r}: not a number (MB/s for --read-mbps, reads "
                               "per second for --read-iops)") from None

        return cls(number(read_mbps, "--read-mbps", float), number(read_iops, "--read-iops", int))

    @property
    def active(self) -> bool:
        return self.read_mbps is not None or self.read_iops is not None

    @property
    def read_bps(self) -> int | None:
        return None if self.read_mbps is None else int(self.read_mbps * MB)


def block_device(path: Path) -> str:
    """'MAJ:MIN' of the whole disk holding `path` (a partition maps to its parent disk: the
    throttle only takes whole devices)."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise BadInput(f"{path}: cannot stat ({err.strerror})") from None
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dir = Path("/sys/dev/block") / dev
    if not sys_dir.exists():
        raise ThrottleUnavailable(f"{path}: its filesystem is not on a block device ({dev}: "
                                  "tmpfs, overlay or network?): reads cannot be throttled")
    if (sys_dir / "partition").exists():
        parent = (sys_dir.resolve().parent / "dev")
        dev = parent.read_text().strip()
    return dev


def throttle_settings(spec: ThrottleSpec, device: str, version: str) -> list[tuple[str, str]]:
    """The files and values that set `spec` on `device` in that hierarchy."""
    bps, iops = spec.read_bps, spec.read_iops
    if version == "v1":
        out = []
        if bps is not None:
            out.append(("blkio.throttle.read_bps_device", f"{device} {bps}"))
        if iops is not None:
            out.append(("blkio.throttle.read_iops_device", f"{device} {iops}"))
        return out
    parts = [device] + ([f"rbps={bps}"] if bps is not None else []) \
        + ([f"riops={iops}"] if iops is not None else [])
    return [("io.max", " ".join(parts))]


def check_available(spec: ThrottleSpec) -> None:
    """Raise ThrottleUnavailable (one line) when `spec` cannot be applied on this machine."""
    if not spec.active:
        return
    try:
        check_controllers(["io"], "--read-mbps/--read-iops")
    except CgroupUnavailable as err:
        raise ThrottleUnavailable(str(err)) from None
