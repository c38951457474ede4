"""What advise knows of a model: its size, native K, the prerouter heads it has (per K), the
reads in flight calibrated for it, and the quality rows `ssdmoe eval` wrote for it.

A model is a converted streaming directory (manifest.json) or only a model profile
(scenarios/models/NAME.toml: the paper's 35B), in which case the commands it prints name the
directory the model would be converted to."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.engine_config import DEFAULT_READERS
from contract.errors import BadInput

QUALITY_DIR = Path("reports/quality")
# eval's rows (engine.train.quality): the model's own routers, and the heads' routing
OWN_ROUTERS, PREROUTED = "int4, own routers", "int4 prerouted, no LoRA"


@dataclass
class ModelInfo:
    name: str  # the directory's name (or the profile's)
    profile: str  # the model profile's name (scenarios/models/NAME.toml)
    path: Path | None  # the converted directory; None: a profile only
    layers: int
    experts: int
    k: int  # native top-K
    bundle_bytes: int
    heads: dict[int, str] = field(default_factory=dict)  # K -> prerouter heads directory
    readers: int = DEFAULT_READERS  # the calibrated reads in flight (queue_depth.json)
    routing_k: list[int] = field(default_factory=list)  # K the profile's routing was fitted at

    @property
    def expert_bytes(self) -> int:
        return self.layers * self.experts * self.bundle_bytes

    @property
    def where(self) -> str:
        return str(self.path) if self.path is not None else f"models/{self.name}-stream"

    def run_model(self) -> dict[str, Any]:
        """run.json's `model` as a capture of this model would write it."""
        out: dict[str, Any] = {"name": self.name, "layers": self.layers,
                               "experts": self.experts, "bundle_bytes": self.bundle_bytes}
        if self.path is not None:
            out["path"] = str(self.path)
        return out

    def quality(self, k: int, prerouted: bool) -> dict[str, float] | None:
        """`ssdmoe eval`'s row for this K (perplexity, top-1 agreement with the teacher), or
        None where eval has not run at this K."""
        path = QUALITY_DIR / f"{self.name}-k{k}.json"
        if not path.is_file():
            return None
        try:
            rows = json.loads(path.read_text())["rows"]
            row = rows[PREROUTED if prerouted else OWN_ROUTERS]
            return {"ppl": float(row["ppl"]), "top1": float(row["top1"]), "source": str(path)}
        except (ValueError, KeyError, TypeError):
            return None


def _heads(model_dir: Path, native: int) -> dict[int, str]:
    """K -> heads directory: MODEL/prerouter (trained at its prerouter.json top_k, else the
    native K) and MODEL/prerouter-kK."""
    out: dict[int, str] = {}
    for d in sorted(model_dir.glob("prerouter*")):
        meta = d / "prerouter.json"
        if not meta.is_file():
            continue
        try:
            k = int(json.loads(meta.read_text()).get("top_k") or native)
        except (ValueError, TypeError, AttributeError):
            raise BadInput(f"{meta}: not a readable prerouter.json") from None
        out.setdefault(k, str(d))
    return out


def _readers(model_dir: Path) -> int:
    path = model_dir / "queue_depth.json"
    if not path.is_file():
        return DEFAULT_READERS
    try:
        return int(json.loads(path.read_text())["readers"])
    except (ValueError, KeyError, TypeError):
        raise BadInput(f"{path}: not a readable queue-depth file (ssdmoe calibrate "
                       "--queue-depth-only)") from None


def load_model(model: str) -> ModelInfo:
    """A converted model directory, or a model profile's name or path."""
    from sim.compare import profile_name
    from sim.model_profile import read_manifest_json
    from sim.profiles import load_model as load_profile

    path = Path(model)
    if path.is_dir():
        m = read_manifest_json(path)
        info = ModelInfo(name=path.name, profile=profile_name(path.name), path=path,
                         layers=len(m["layers"]), experts=int(m["num_experts"]),
                         k=int(m["top_k"]), bundle_bytes=int(m["bundle_bytes"]),
                         readers=_readers(path))
        info.heads = _heads(path, info.k)
    else:
        prof = load_profile(model)
        info = ModelInfo(name=prof.name, profile=prof.name, path=None, layers=prof.layers,
                         experts=prof.experts, k=prof.k, bundle_bytes=prof.bundle_bytes)
        if prof.consumer_count > 0:
            info.heads = {prof.k: f"{info.where}/prerouter"}
    try:
        info.routing_k = list(load_profile(info.profile).routing_k)
    except BadInput:
        info.routing_k = []
    return info
