"""A layer file's experts as stacked arrays [E, ...] per tensor name, in either layout
(engine.manifest): the stacked layout's tensors as they are, the bundled layout's per-expert
slices stacked back. For loading every expert at once (the resident reference, export)."""

from __future__ import annotations

from engine.manifest import Manifest
from engine.safetensors_io import read_safetensors_header


def stacked_experts(manifest: Manifest, layer: int) -> dict:
    """{tensor name: mx.array [E, ...]} of `layer`'s routed experts, in the manifest's order."""
    import mlx.core as mx

    entry = manifest.layers[layer]
    path = manifest.path(entry.file)
    read_safetensors_header(path)
    arrays = mx.load(str(path))
    if manifest.layout == "stacked":
        return {name: arrays[name] for name in entry.tensors}
    return {name: mx.stack([arrays[f"experts.{e}.{name}"] for e in range(entry.experts)])
            for name in entry.tensors}
