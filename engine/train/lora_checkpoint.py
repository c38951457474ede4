"""Training checkpoints for the recovery LoRA (`ssdmoe train sft|distill`): OUT.partial holds
identity.json (what is being trained: model, heads, phase, data, seed, config), data.npz (the
sampled sequences) and state.safetensors (adapter and optimizer state, step). A run resumes
only a checkpoint of the same identity; another is refused and kept (`--restart` replaces it).
Every file is written whole and renamed into place."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from contract.errors import BadInput
from engine import lora
from traces.writer import write_atomic


class Checkpoint:
    """`dir`/identity.json, data.npz (the generated rows), state.safetensors (adapter +
    optimizer, step in metadata). Written atomically; refused when the identity differs."""

    def __init__(self, root: Path, identity: dict):
        self.root, self.identity = Path(root), identity

    def check(self) -> bool:
        """True when a checkpoint of this run exists; BadInput when one of another run does."""
        f = self.root / "identity.json"
        if not f.is_file():
            return False
        try:
            theirs = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise BadInput(f"{f}: unreadable checkpoint identity ({err}); move it away or "
                           "pass --restart") from None
        for key in sorted(set(theirs) | set(self.identity)):
            if theirs.get(key) != self.identity.get(key):
                raise BadInput(f"{self.root}: checkpoint of another run ({key}: "
                               f"{theirs.get(key)!r} there, {self.identity.get(key)!r} now); "
                               "it is kept: pass --restart to discard it, or change --out")
        return True

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_text(self.root / "identity.json", json.dumps(self.identity, indent=1))

    def save_data(self, **arrays: np.ndarray) -> None:
        tmp = self.root / "data.tmp.npz"
        np.savez(tmp, **arrays)
        tmp.replace(self.root / "data.npz")

    def load_data(self) -> dict[str, np.ndarray] | None:
        f = self.root / "data.npz"
        if not f.is_file():
            return None
        with np.load(f) as d:
            return {k: d[k] for k in d.files}

    def save_state(self, model: nn.Module, opt: optim.Optimizer, step: int,
                   history: list[dict]) -> None:
        arrays = {f"adapter.{k}": v for k, v in lora.adapter_arrays(model).items()}
        arrays.update({f"opt.{k}": v for k, v in tree_flatten(opt.state)})
        tmp = self.root / "state.tmp.safetensors"
        mx.save_safetensors(str(tmp), arrays, metadata={
            "step": str(step), "history": json.dumps(history)})
        tmp.replace(self.root / "state.safetensors")

    def load_state(self, model: nn.Module, opt: optim.Optimizer) -> tuple[int, list[dict]]:
        f = self.root / "state.safetensors"
        if not f.is_file():
            return 0, []
        try:
            arrays, meta = mx.load(str(f), return_metadata=True)
        except Exception as err:  # noqa: BLE001
            raise BadInput(f"{f}: unreadable checkpoint ({err}); pass --restart") from None
        lora.set_arrays(model, {k[len("adapter."):]: v for k, v in arrays.items()
                                if k.startswith("adapter.")})
        opt.state = tree_unflatten([(k[4:], v) for k, v in arrays.items()
                                    if k.startswith("opt.")])
        mx.eval(model.parameters(), opt.state)
        return int(meta["step"]), json.loads(meta["history"])


def atomic_text(path: Path, text: str) -> None:
    """`text` written whole under a temporary name and renamed (traces.writer.write_atomic;
    no fsync: it guards against a killed run, as the training state's writes do)."""
    write_atomic(path, lambda tmp: tmp.write_text(text + "\n"), durable=False)
