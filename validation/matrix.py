"""The validation matrix: real configurations of this machine to capture and to predict.

Axes (each value a real engine setting):
  page_cache  expert bytes the page cache may hold: "all" (no budget), "1/2", "1/4"
  path        on-demand | hot | staged | staged-token (prerouter heads, one token ahead) |
              staged-layer (same token, one layer ahead)
  storage     "unthrottled", or a read throttle (the kernel's block-I/O throttle): "<N>mbps"
              (MB/s) or "<N>iops" (reads per second)
  k           "native" or experts per token

Every axis is swept with the others at their defaults, plus a few corner combinations. One
named configuration is the calibration subset's (with the microbenchmarks of `ssdmoe
calibrate`); every other configuration is held out and only predicted. A matrix file (TOML)
may replace the defaults: [axes] (values per axis), [defaults], optional [[corners]] and
[calibration]. No MLX here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import BadInput, read_toml_table
from contract.thresholds import PAGE_CACHE_SHARES

AXES = ("page_cache", "path", "storage", "k")
PATHS = ("on-demand", "hot", "staged", "staged-token", "staged-layer")


@dataclass(frozen=True)
class Config:
    page_cache: str = "1/4"
    path: str = "on-demand"
    storage: str = "unthrottled"  # or "<N>mbps"
    k: str = "native"  # or "<N>"
    role: str = "held-out"  # or "calibration"

    @property
    def name(self) -> str:
        pc = {"all": "pcall", "1/2": "pc50", "1/4": "pc25"}[self.page_cache]
        k = "" if self.k == "native" else f"-k{self.k}"
        return f"{self.path}-{pc}-{self.storage}{k}"

    @property
    def read_mbps(self) -> float | None:
        return float(self.storage[:-4]) if self.storage.endswith("mbps") else None

    @property
    def read_iops(self) -> int | None:
        return int(self.storage[:-4]) if self.storage.endswith("iops") else None

    @property
    def throttled(self) -> bool:
        return self.storage != "unthrottled"

    def capture_args(self, heads: Path | None) -> list[str]:
        """`ssdmoe capture` options that run this configuration."""
        preset = "on-demand" if self.path == "on-demand" else \
            "hot" if self.path == "hot" else "staged"
        args = ["--preset", preset]
        if self.path == "staged-token":
            if heads is None:
                raise BadInput("validate: staged-token needs prerouter heads (ssdmoe train heads)")
            args += ["--prerouter", str(heads)]
        if self.path == "staged-layer":
            args += ["--lead", "layer"]
        fraction = PAGE_CACHE_SHARES[self.page_cache]
        if fraction is not None:
            args += ["--page-cache-fraction", str(fraction)]
        if self.read_mbps is not None:
            args += ["--read-mbps", f"{self.read_mbps:g}"]
        if self.read_iops is not None:
            args += ["--read-iops", str(self.read_iops)]
        if self.k != "native":
            args += ["--top-k", self.k]
        return args

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name}


@dataclass
class Matrix:
    axes: dict[str, list[str]]
    defaults: Config
    corners: list[Config] = field(default_factory=list)
    calibration: list[Config] = field(default_factory=list)

    def configs(self) -> list[Config]:
        """Calibration first, then each axis swept from the defaults, then the corners. A
        sweep point equal to a calibration configuration is measured once, as calibration:
        it is not held out (the report lists it under calibration)."""
        out: list[Config] = list(self.calibration)
        held = [self.defaults]
        for axis in AXES:
            for value in self.axes[axis]:
                held.append(_with(self.defaults, axis, value))
        held += self.corners
        if self.defaults.name in {c.name for c in self.calibration}:
            raise BadInput(f"validate matrix: the defaults ({self.defaults.name}) are a "
                           "calibration configuration: nothing would be held out around them")
        seen = {c.name for c in self.calibration}
        for c in held:
            if c.name not in seen:
                out.append(c)
                seen.add(c.name)
        return out


def _with(c: Config, axis: str, value: str) -> Config:
    d = asdict(c)
    d[axis] = value
    return Config(**d)


def _storage(v: Any, where: str) -> str:
    if v == "unthrottled":
        return v
    text = str(v)
    unit = "iops" if text.endswith("iops") else "mbps"
    try:
        rate = float(text.removesuffix(unit))
    except ValueError:
        raise BadInput(f"{where}: storage {v!r}: expected \"unthrottled\", MB/s (\"40mbps\" "
                       "or 40) or reads per second (\"500iops\")") from None
    if rate <= 0:
        raise BadInput(f"{where}: storage {v!r}: a throttle must be > 0")
    return f"{int(rate)}iops" if unit == "iops" else f"{rate:g}mbps"


def _k(v: Any, where: str) -> str:
    if v == "native":
        return v
    if isinstance(v, bool) or not str(v).isdigit() or int(v) < 1:
        raise BadInput(f"{where}: k {v!r}: expected \"native\" or an integer >= 1")
    return str(int(v))


def _value(axis: str, v: Any, where: str) -> str:
    if axis == "page_cache":
        if v not in PAGE_CACHE_SHARES:
            raise BadInput(f"{where}: page_cache {v!r}: one of {', '.join(PAGE_CACHE_SHARES)}")
        return v
    if axis == "path":
        if v not in PATHS:
            raise BadInput(f"{where}: path {v!r}: one of {', '.join(PATHS)}")
        return v
    if axis == "storage":
        return _storage(v, where)
    return _k(v, where)


def _config(d: Any, where: str, base: Config, role: str = "held-out") -> Config:
    if not isinstance(d, dict):
        raise BadInput(f"{where}: expected a table of axis = value")
    bad = set(d) - set(AXES)
    if bad:
        raise BadInput(f"{where}: unknown axis {sorted(bad)[0]!r} (axes: {', '.join(AXES)})")
    values = asdict(base)
    values.update({a: _value(a, v, where) for a, v in d.items()})
    values["role"] = role
    return Config(**values)


def default_matrix(quick: bool = False, throttles: list[str] | None = None) -> Matrix:
    """The built-in matrix. Defaults: on-demand, a page cache of 1/4 of the expert bytes (so
    storage matters), unthrottled, native K. Throttles: 40 MB/s (around on-demand's demand
    rate at 1/4) and 15 MB/s (well below it), or `throttles`; the corners run at the last
    one. --quick keeps every axis but fewer corners."""
    throttles = [_storage(t, "--read-mbps/--read-iops") for t in (throttles or
                                                                   ["40mbps", "15mbps"])]
    slow = throttles[-1]
    axes = {"page_cache": ["all", "1/2", "1/4"], "path": list(PATHS),
            "storage": ["unthrottled", *throttles], "k": ["native", "2"]}
    defaults = Config()
    corners = [Config(path="staged-token", storage=slow),
               Config(path="staged-layer", storage=slow)]
    if not quick:
        corners += [Config(path="staged", storage=slow), Config(path="hot", storage=slow),
                    Config(path="staged", k="2"), Config(path="on-demand", k="8")]
    # one per decode path, every expert in the page cache (no storage effects): they fit
    # each path's main-thread cost inside decode; and one that reads cold on the main thread
    # only (on-demand, 1/2 page cache, unthrottled): it fits a cold read's cost inside decode;
    # and one whose reader threads read cold (hot, 1/2 page cache): it fits the hand-off of
    # their loads inside decode; and the staged path with heads, every expert in the page
    # cache: it fits the heads' graph building; and the staged path with the layer lead,
    # every expert in the page cache: it fits that lead's own hand-over per fill point
    # (validation.decode_fits)
    calibration = [Config(path=p, page_cache="all", role="calibration")
                   for p in ("on-demand", "hot", "staged", "staged-token", "staged-layer")]
    calibration += [Config(path=p, page_cache="1/2", role="calibration")
                    for p in ("on-demand", "hot")]
    return Matrix(axes, defaults, corners, calibration)


def load_matrix(path: Path) -> Matrix:
    """A matrix file: [axes], [defaults], [[corners]], [calibration] (see the module doc)."""
    data = read_toml_table(path)
    bad = set(data) - {"axes", "defaults", "corners", "calibration"}
    if bad:
        raise BadInput(f"{path}: unknown section {sorted(bad)[0]!r} "
                       "(sections: axes, defaults, corners, calibration)")
    axes_in = data.get("axes") or {}
    if not isinstance(axes_in, dict):
        raise BadInput(f"{path}: [axes]: expected a table")
    unknown = set(axes_in) - set(AXES)
    if unknown:
        raise BadInput(f"{path}: [axes]: unknown axis {sorted(unknown)[0]!r} "
                       f"(axes: {', '.join(AXES)})")
    base = default_matrix()
    axes = {}
    for a in AXES:
        values = axes_in.get(a, base.axes[a])
        if not isinstance(values, list) or not values:
            raise BadInput(f"{path}: [axes] {a}: expected a non-empty list")
        axes[a] = [_value(a, v, f"{path}: [axes]") for v in values]
    defaults = _config(data.get("defaults") or {}, f"{path}: [defaults]", Config())
    corners = [_config(c, f"{path}: [[corners]] #{i + 1}", defaults)
               for i, c in enumerate(data.get("corners") or [])]
    cal = data.get("calibration")
    calibration = base.calibration if cal is None else \
        [_config(cal, f"{path}: [calibration]", defaults, role="calibration")]
    return Matrix(axes, defaults, corners, calibration)
