"""This process in fresh control groups: the kernel's own limits, set on one process and its
threads (and inherited by its children), removed again on leaving.

    with ProcessGroups({"memory": [("memory.limit_in_bytes", "734003200")]}) as groups:
        ...                          # this process now runs under those limits
        groups.mechanism()          # {"memory": "cgroup v1 memory"}

Two hierarchies, each found per controller:
  cgroup v1  one hierarchy per controller (/sys/fs/cgroup/blkio, memory, cpuset, cpu): one
             group `ssdmoe-<pid>` in each hierarchy used, a child of the process's own group;
  cgroup v2  one unified hierarchy: one group `ssdmoe-<pid>` holding every controller's files,
             where the parent enables those controllers for its children.
Leaving moves the process back where it was and removes the groups: on normal exit, on an
exception (Ctrl-C included) and, as a last resort, at interpreter exit. Groups left by a
process that was killed (SIGKILL leaves no chance) are removed by the next one. No MLX here."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from contract.errors import BadInput

ROOT = Path("/sys/fs/cgroup")
PREFIX = "ssdmoe-"
# controller -> (its v1 hierarchy's directory, a file that exists only where it is mounted)
V1 = {"io": ("blkio", "blkio.throttle.read_bps_device"),
      "memory": ("memory", "memory.limit_in_bytes"),
      "cpuset": ("cpuset", "cpuset.cpus"),
      "cpu": ("cpu", "cpu.cfs_quota_us")}

Settings = dict[str, list[tuple[str, str]]]  # controller -> (file, value) in writing order


class CgroupUnavailable(BadInput):
    """A limit cannot be set on this machine (one line saying why)."""


def hierarchy(controller: str, root: Path = ROOT) -> tuple[str, Path]:
    """('v1', that controller's hierarchy) or ('v2', the unified root enabling it)."""
    name, probe = V1[controller]
    if (root / name / probe).exists():
        return "v1", root / name
    for unified in (root / "unified", root):
        ctl = unified / "cgroup.subtree_control"
        if ctl.exists() and controller in ctl.read_text().split():
            return "v2", unified
    raise CgroupUnavailable(f"no cgroup v1 {name} hierarchy and no cgroup v2 {controller} "
                            f"controller enabled under {root}")


def check_controllers(controllers: list[str], what: str, root: Path = ROOT) -> None:
    """Raise CgroupUnavailable (one line naming `what`) unless every controller can be set."""
    if sys.platform != "linux":
        raise CgroupUnavailable(f"{what}: {sys.platform} has no control groups (Linux only); "
                                "run without it")
    if os.geteuid() != 0:
        raise CgroupUnavailable(f"{what}: setting a control group needs root")
    for c in controllers:
        try:
            hierarchy(c, root)
        except CgroupUnavailable as err:
            raise CgroupUnavailable(f"{what}: {err}") from None


def current_group(version: str, hierarchy_dir: Path) -> str:
    """This process's group path in that hierarchy (to move back to)."""
    name = hierarchy_dir.name
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if version == "v1" and name in controllers.split(","):
            return path
        if version == "v2" and hid == "0":
            return path
    return "/"


def remove_stale(hierarchy_dir: Path) -> None:
    """Empty groups of this tool whose process is gone."""
    for group in hierarchy_dir.glob(f"{PREFIX}*"):
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


class ProcessGroups:
    """Context manager: this process in fresh groups carrying `settings`."""

    def __init__(self, settings: Settings, root: Path = ROOT, what: str = "control group"):
        self.settings, self.root, self.what = settings, root, what
        self.entered: list[tuple[str, Path, Path, str]] = []  # version, hierarchy, group, home
        self.versions: dict[str, str] = {}

    def __enter__(self) -> ProcessGroups:
        if not self.settings:
            return self
        check_controllers(list(self.settings), self.what, self.root)
        by_dir: dict[Path, list[tuple[str, str]]] = {}
        version_of: dict[Path, str] = {}
        for controller, files in self.settings.items():
            version, where = hierarchy(controller, self.root)
            self.versions[controller] = version
            by_dir.setdefault(where, []).extend(files)
            version_of[where] = version
        atexit.register(self.leave)
        try:
            for where, files in by_dir.items():
                self._enter_one(version_of[where], where, files)
        except BaseException:
            self.leave()
            raise
        return self

    def _enter_one(self, version: str, where: Path, files: list[tuple[str, str]]) -> None:
        home = current_group(version, where)
        # v1: inside the group the process is in, so whatever limits its parent has still hold
        # (and whoever tracks the process by its group still finds it); v2 forbids a group with
        # processes from delegating controllers to children, so there it is the root's child
        parent = where / home.lstrip("/") if version == "v1" else where
        if not parent.is_dir():
            parent = where
        remove_stale(parent)
        group = parent / f"{PREFIX}{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
        except OSError as err:
            raise CgroupUnavailable(f"{self.what}: cannot make {group} ({err.strerror})") \
                from None
        self.entered.append((version, where, group, home))
        for name, value in files:
            try:
                (group / name).write_text(value)
            except OSError as err:
                raise CgroupUnavailable(f"{self.what}: the kernel refused {value!r} in "
                                        f"{group / name} ({err.strerror})") from None
        try:
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as err:
            raise CgroupUnavailable(f"{self.what}: cannot move this process into {group} "
                                    f"({err.strerror})") from None

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def leave(self) -> None:
        """Move back home and remove the groups (idempotent)."""
        while self.entered:
            _version, where, group, home = self.entered.pop()
            for target in (where / home.lstrip("/"), where):
                try:
                    (target / "cgroup.procs").write_text(str(os.getpid()))
                    break
                except OSError:
                    continue
            try:
                group.rmdir()
            except OSError:
                pass  # a child still in it: the kernel keeps the group until it is empty

    def group_dir(self, controller: str) -> Path:
        """The group this process is in for `controller` (its files: memory.stat, ...)."""
        for version, where, group, _home in self.entered:
            if hierarchy(controller, self.root) == (version, where):
                return group
        raise KeyError(f"no group entered for {controller}")

    def mechanism(self, controller: str) -> str:
        """'cgroup v1 memory', 'cgroup v2 memory', ... for run.json."""
        version = self.versions.get(controller, "")
        name = V1[controller][0] if version == "v1" else controller
        return f"cgroup {version} {name}"
