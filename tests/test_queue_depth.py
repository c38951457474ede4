"""Reads in flight: chosen from the measured curve (the fewest reaching 90% of the best),
taken from the model directory's queue_depth.json when the engine is not told, recorded in
run.json, and bad values refused in one line."""

from __future__ import annotations

import json

import pytest

from contract.engine_config import DEFAULT_READERS, EngineConfig
from contract.errors import BadInput
from engine import queue_depth
from engine.manifest import read_manifest


def test_choose_the_knee_by_hand():
    assert queue_depth.choose({1: 1.0, 2: 1.7, 4: 2.0, 8: 1.9}) == 4  # 1.7 < 0.9 x 2.0
    assert queue_depth.choose({1: 1.0, 2: 1.85, 4: 2.0}) == 2  # 1.85 >= 1.8
    assert queue_depth.choose({1: 3.0, 2: 2.0}) == 1


def test_default_comes_from_the_models_record(tiny_random_converted, model_copy):
    root = model_copy(tiny_random_converted)
    m = read_manifest(root)
    n, source = queue_depth.default_readers(root, m.bundle_bytes)
    assert n == DEFAULT_READERS and "not measured" in source
    queue_depth.write(root, {1: 1.0, 2: 1.5, 3: 1.95, 4: 2.0}, m.bundle_bytes, "by hand")
    n, source = queue_depth.default_readers(root, m.bundle_bytes)
    assert n == 3 and str(root / queue_depth.FILE) in source
    # measured with another read size: not this model's curve
    n, source = queue_depth.default_readers(root, m.bundle_bytes * 2)
    assert n == DEFAULT_READERS and "re-run calibrate" in source


def test_the_engine_takes_the_default_and_records_it(tiny_random_converted, model_copy):
    from engine.loader import load_streaming

    root = model_copy(tiny_random_converted)
    m = read_manifest(root)
    queue_depth.write(root, {1: 1.0, 3: 2.0}, m.bundle_bytes, "by hand")
    eng = load_streaming(root, config=EngineConfig.from_preset("staged"))
    try:
        assert eng.runtime.readers.n == 3
        d = eng.config.to_dict()
        assert d["readers"] == 3 and "queue_depth.json" in d["readers_source"]
    finally:
        eng.close()
    eng = load_streaming(root, config=EngineConfig.from_preset("staged", readers=1))
    try:
        assert eng.runtime.readers.n == 1 and eng.config.readers_source == "given"
    finally:
        eng.close()


@pytest.mark.parametrize("value", [0, 65, "2"])
def test_a_bad_record_is_one_line(tiny_random_converted, model_copy, value):
    root = model_copy(tiny_random_converted)
    (root / queue_depth.FILE).write_text(json.dumps({"readers": value, "read_bytes": 1}))
    with pytest.raises(BadInput) as err:
        queue_depth.default_readers(root, 1)
    assert "\n" not in str(err.value) and str(root / queue_depth.FILE) in str(err.value)


def test_not_json_is_one_line(tmp_path):
    (tmp_path / queue_depth.FILE).write_text("{")
    with pytest.raises(BadInput, match="not a queue-depth record"):
        queue_depth.default_readers(tmp_path, 1)
