"""Emulated storage speed on real hardware: the kernel's block-I/O throttle on the device that
holds the model, applied to this process (its threads and children inherit it).

    with ReadThrottle(model_dir, read_mbps=50) as th:   # reads from that disk <= 50 MB/s
        ...run the engine...
        run_json["throttle"] = th.record()

Linux only, as root. Two hierarchies:
  cgroup v1  /sys/fs/cgroup/blkio/<group>/blkio.throttle.read_bps_device ("MAJ:MIN BYTES"),
             read_iops_device likewise;
  cgroup v2  <unified>/<group>/io.max ("MAJ:MIN rbps=BYTES riops=N"), where the io controller
             is enabled for the parent's children.
The throttle is not a slow pipe: both are the kernel's blk-throttle, which grants a whole
slice's bytes (throtl_slice, 100 ms) at the slice's start, so reads pass at full speed until
the slice's allowance is spent and then wait for the next slice. `BURST_S` is that slice; the
simulator models the same mechanism (sim.throttle.SliceThrottle).

Setting up moves this process into a fresh cgroup; leaving moves it back and removes the group,
on normal exit, on an exception (Ctrl-C included) and, as a last resort, at interpreter exit.
Rates are decimal: 1 MB/s = 10^6 bytes/s (as `ssd_bandwidth_gbps` is 10^9 bytes/s).
No MLX here."""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.errors import BadInput

V1_ROOT = Path("/sys/fs/cgroup/blkio")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
BURST_S = 0.1  # v1 blk-throttle's slice (throtl_slice = HZ/10): what passes at full speed
MB = 10**6


class ThrottleUnavailable(BadInput):
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


def _hierarchy() -> tuple[str, Path]:
    """('v1', blkio root) or ('v2', unified root with the io controller)."""
    if (V1_ROOT / "blkio.throttle.read_bps_device").exists():
        return "v1", V1_ROOT
    for root in V2_ROOTS:
        ctl = root / "cgroup.subtree_control"
        if ctl.exists() and "io" in ctl.read_text().split():
            return "v2", root
    raise ThrottleUnavailable("reads cannot be throttled here: no cgroup v1 blkio throttle and "
                              "no cgroup v2 io controller enabled")


def _current_group(version: str) -> str:
    """This process's cgroup path in that hierarchy (to move back to)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if version == "v1" and "blkio" in controllers.split(","):
            return path
        if version == "v2" and hid == "0":
            return path
    return "/"


def check_available(spec: ThrottleSpec) -> None:
    """Raise ThrottleUnavailable (one line) when `spec` cannot be applied on this machine."""
    if not spec.active:
        return
    if sys.platform != "linux":
        raise ThrottleUnavailable(f"--read-mbps/--read-iops: {sys.platform} has no block-I/O "
                                  "throttle this tool can set (Linux cgroups only)")
    if os.geteuid() != 0:
        raise ThrottleUnavailable("--read-mbps/--read-iops: setting the block-I/O throttle "
                                  "needs root")
    _hierarchy()


def _remove_stale(root: Path) -> None:
    """Empty groups of processes that were killed (SIGKILL leaves no chance to clean up)."""
    for group in root.glob("ssdmoe-throttle-*"):
        try:
            pid = int(group.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
            continue  # its process is alive
        except (ValueError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        try:
            group.rmdir()
        except OSError:
            pass


class ReadThrottle:
    """Context manager: this process's reads from the disk holding `path` throttled."""

    def __init__(self, path: Path, spec: ThrottleSpec):
        self.path, self.spec = Path(path), spec
        self.group: Path | None = None
        self.version = ""
        self.device = ""
        self.home = "/"
        self.root = V1_ROOT

    def __enter__(self) -> ReadThrottle:
        if not self.spec.active:
            return self
        check_available(self.spec)
        self.device = block_device(self.path)
        self.version, self.root = _hierarchy()
        self.home = _current_group(self.version)
        _remove_stale(self.root)
        group = self.root / f"ssdmoe-throttle-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            self.group = group
            self._write_limits(group)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as err:
            self._leave()
            raise ThrottleUnavailable(f"--read-mbps/--read-iops: cannot set the throttle in "
                                      f"{group} ({err.strerror})") from None
        atexit.register(self._leave)
        return self

    def _write_limits(self, group: Path) -> None:
        bps, iops = self.spec.read_bps, self.spec.read_iops
        if self.version == "v1":
            if bps is not None:
                (group / "blkio.throttle.read_bps_device").write_text(f"{self.device} {bps}")
            if iops is not None:
                (group / "blkio.throttle.read_iops_device").write_text(f"{self.device} {iops}")
        else:
            parts = [self.device]
            if bps is not None:
                parts.append(f"rbps={bps}")
            if iops is not None:
                parts.append(f"riops={iops}")
            (group / "io.max").write_text(" ".join(parts))

    def __exit__(self, *exc: object) -> None:
        self._leave()

    def _leave(self) -> None:
        """Move back home and remove the group (idempotent)."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            (self.root / self.home.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            (self.root / "cgroup.procs").write_text(str(os.getpid()))
        try:
            group.rmdir()
        except OSError:
            pass  # a child still in it: the kernel keeps the group until it is empty

    def record(self) -> dict[str, Any] | None:
        """run.json `throttle`: what was set, where and how (None when unthrottled)."""
        if not self.spec.active:
            return None
        return {"read_mbps": self.spec.read_mbps, "read_bps": self.spec.read_bps,
                "read_iops": self.spec.read_iops, "device": self.device,
                "mechanism": ("cgroup v1 blkio.throttle" if self.version == "v1"
                              else "cgroup v2 io.max"),
                "burst_s": BURST_S}
