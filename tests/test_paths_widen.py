"""`tiny-trained-wide`'s builder: zero-padding the experts' intermediate dimension after
quantization keeps the function exactly (same logits, bit for bit) while the bundles grow."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from contract.errors import BadInput
from engine.convert import convert
from engine.fixtures import FIXTURES
from engine.fixtures.widen import build_tiny_trained_wide
from engine.loader import load_resident
from engine.manifest import read_manifest


def test_widened_equals_original(tiny_random_dir, tiny_random_converted, tmp_path):
    wide = build_tiny_trained_wide(tmp_path / "wide", trained=tiny_random_dir, width=320)
    assert json.loads((wide / "config.json").read_text())["moe_intermediate_size"] == 320
    convert(wide, tmp_path / "wide-stream")
    a, tok = load_resident(tiny_random_converted)
    b, _ = load_resident(tmp_path / "wide-stream")
    x = mx.array(tok.encode("def widen(x): return x + 0  # same function"))[None]
    assert np.array_equal(np.array(a(x)), np.array(b(x)))
    small = read_manifest(tiny_random_converted).bundle_bytes
    big = read_manifest(tmp_path / "wide-stream").bundle_bytes
    assert big == small * 320 // 128  # every part of a bundle scales with the width
    assert "tiny-trained-wide" in FIXTURES


def test_widen_needs_the_trained_model(tmp_path):
    with pytest.raises(BadInput, match="tiny-trained not found"):
        build_tiny_trained_wide(tmp_path / "wide", trained=tmp_path / "missing")
