"""A layer file's experts stacked [E, ...] per tensor name, read by the safetensors library
itself (an independent reference for the engine's offsets): the stacked layout's tensors as
they are, the bundled layout's `experts.{e}.{name}` slices stacked (padding left out)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_PER_EXPERT = re.compile(r"experts\.(\d+)\.(.+)")


def stacked_reference(path: Path | str) -> dict[str, np.ndarray]:
    return stack_experts(load_file(str(path)))


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A layer file's tensors as stacks: unchanged when stacked already, else the bundled
    layout's per-expert slices stacked in expert order (padding left out)."""
    per_expert: dict[str, dict[int, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _PER_EXPERT.fullmatch(key)
        if m is None:
            return tensors  # the stacked layout
        if m.group(2) != "pad":
            per_expert.setdefault(m.group(2), {})[int(m.group(1))] = value
    return {name: np.stack([slices[e] for e in sorted(slices)])
            for name, slices in per_expert.items()}
