"""Expert files are trusted only while they are the verified files (engine.file_watch): a file
rewritten in place at the same size, truncated or replaced is refused in one line naming it,
the experts loaded from it are dropped (the staged slots and hot rows are empty afterwards),
and once the file is restored (its sha256 matches the manifest again) generation is exactly
what it was before the change."""

from __future__ import annotations

import os

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
        return sum(1 for key in hot.lru if key[0] == lay)

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
