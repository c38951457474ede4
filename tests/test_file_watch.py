"""Expert files are trusted only while they are the verified files (engine.file_watch): a file
rewritten in place at the same size, truncated or replaced is refused in one line naming it,
the experts loaded from it are dropped (the staged slots and hot rows are empty afterwards),
and once the file is restored (its sha256 matches the manifest again) generation is exactly
what it was before the change."""

from __future__ import annotations

import os
import zlib

import pytest

from contract.engine_config import EngineConfig
from engine.file_watch import ExpertFileChanged
from engine.loader import load_streaming
from server.worker import _watch

PROMPT = "def parse(argv):\n    "


def _gen(eng) -> list[int]:
    return eng.generate(PROMPT, 12, temp=1.0, seed=3).tokens


@pytest.mark.parametrize("preset", ["staged", "hot"])
def test_a_changed_file_is_refused_dropped_and_trusted_again_when_restored(
        preset, tiny_random_converted, model_copy):
    root = model_copy(tiny_random_converted)
    eng = load_streaming(root, config=EngineConfig.from_preset(preset))
    watch = _watch(eng)
    layer = eng.manifest.moe_layers[1]
    path = root / eng.manifest.layers[layer].file
    saved = path.read_bytes()
    before = _gen(eng)
    staged = eng.runtime.staged()
    hot = eng.runtime.hot

    def loaded(lay: int) -> int:
        if preset == "staged":
            return len(staged[lay].resident())
        return sum(1 for key in hot.row_of if key[0] == lay)

    assert loaded(layer) > 0
    watch.check()  # nothing changed: nothing happens
    assert loaded(layer) > 0

    with open(path, "r+b") as f:  # in place, same size: zeros over the whole file
        f.write(bytes(len(saved)))
    with pytest.raises(ExpertFileChanged) as err:
        watch.check()
    msg = str(err.value)
    assert eng.manifest.layers[layer].file in msg and "sha256" in msg and str(root) not in msg
    assert loaded(layer) == 0  # what was read from it is gone
    assert loaded(eng.manifest.moe_layers[0]) > 0  # other files' experts are kept
    with pytest.raises(ExpertFileChanged):  # still refused, without hashing again
        watch.check()

    os.truncate(path, 1000)
    with pytest.raises(ExpertFileChanged, match=f"size is 1000 bytes, {len(saved)} expected"):
        watch.check()

    replaced = path.with_suffix(".new")  # restored by replacing: a new inode
    replaced.write_bytes(saved)
    os.replace(replaced, path)
    watch.check()  # matches the manifest again: trusted, reopened
    assert _gen(eng) == before
    eng.close()


def test_cold_reads_are_checked_against_the_manifests_crc32(tiny_random_converted, model_copy):
    """The converter records each bundle's crc32; a store asked to verify cold reads fails a
    bundle whose bytes changed (here with the modification time put back, which the file watch
    cannot see) and reads the others as before; unasked, it reads the bad bytes."""
    import numpy as np
    from safetensors.numpy import load_file

    from engine.manifest import read_manifest
    from engine.store import ExpertReadError, ExpertStore

    root = model_copy(tiny_random_converted)
    m = read_manifest(root)
    layer = m.moe_layers[1]
    entry = m.layers[layer]
    path = root / entry.file
    tensors = load_file(str(path))  # the reference: the file's own tensors, by name
    for e in range(entry.experts):
        crc = 0
        for name in entry.names:
            crc = zlib.crc32(np.ascontiguousarray(tensors[f"experts.{e}.{name}"]).tobytes(), crc)
        assert crc == entry.bundle_crc32[e]

    offset, _ = entry.expert_range(entry.names[0], 5)
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset + 17)
        byte = f.read(1)
        f.seek(offset + 17)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    def read(store: ExpertStore, expert: int) -> dict:
        buffers = {n: np.zeros(s, dtype=dt) for n, (s, dt) in store.expert_shapes(layer).items()}
        store.drop_page_cache(layer)
        return store.read_bundle(layer, expert, buffers, emit=False)

    with ExpertStore(m) as store:
        store.verify_cold = True
        with pytest.raises(ExpertReadError, match=r"crc32 .* where the manifest has"):
            read(store, 5)
        assert read(store, 6)["cold"]
        store.verify_cold = False
        assert read(store, 5)["cold"]  # unchecked: the bad bytes come back
