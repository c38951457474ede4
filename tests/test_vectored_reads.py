"""One read per expert: the bundled layout's bundle is one vectored read into its destination
buffers, counted by the kernel (/proc/thread-self/io's read syscalls), and the read plan that
groups ranges into reads, by hand. The stacked (version 1) layout still reads, one range per
tensor; an unknown layout version is refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from layer_reference import stacked_reference

from contract.errors import BadInput
from engine import read_plan
from engine.manifest import MANIFEST_FILE, read_manifest
from engine.store import ExpertStore

IO = Path("/proc/thread-self/io")
needs_io = pytest.mark.skipif(not IO.exists(), reason="no /proc/thread-self/io")


def _syscr() -> int:
    """Read-class system calls this thread has made (the kernel's count)."""
    return int(next(line for line in IO.read_text().splitlines()
                    if line.startswith("syscr:")).split()[1])


def _reads(fn) -> int:
    """Read system calls `fn()` makes on this thread, less those of reading the count itself
    (measured around nothing first)."""
    a = _syscr()
    own = _syscr() - a
    before = _syscr()
    fn()
    return _syscr() - before - own


def _buffers(store: ExpertStore, layer: int) -> dict[str, np.ndarray]:
    return {n: np.zeros(s, dtype=dt) for n, (s, dt) in store.expert_shapes(layer).items()}


def _stacks(store: ExpertStore, layer: int) -> dict[str, np.ndarray]:
    t = store.manifest.layers[layer].tensors
    return {n: np.zeros(x.shape, dtype=x.dtype) for n, x in t.items()}


# ---------------------------------------------------------------- the plan, by hand


def test_plan_joins_adjacent_and_small_gaps_splits_large_ones():
    a, b, c, d = (np.zeros(n, np.uint8) for n in (100, 50, 10, 30))
    runs = read_plan.plan([(1000, a), (1100, b), (1160, c), (5000, d)], max_gap=16)
    # a and b back to back; a 10-byte gap before c read into scratch; d far away: its own read
    assert [(r.offset, r.length, len(r.buffers)) for r in runs] == \
        [(1000, 170, 4), (5000, 30, 1)]
    assert runs[0].buffers[0] is a and runs[0].buffers[1] is b and runs[0].buffers[3] is c
    assert runs[0].buffers[2].nbytes == 10


def test_plan_respects_the_iovec_limit():
    bufs = [np.zeros(8, np.uint8) for _ in range(10)]
    runs = read_plan.plan([(8 * i, b) for i, b in enumerate(bufs)], iov_max=4)
    assert [len(r.buffers) for r in runs] == [4, 4, 2]
    assert [r.offset for r in runs] == [0, 32, 64]
    with pytest.raises(ValueError, match="overlaps"):
        read_plan.plan([(0, bufs[0]), (4, bufs[1])])


def test_tail_resumes_inside_a_buffer():
    a, b = np.arange(4, dtype=np.uint8), np.arange(6, dtype=np.uint8)
    left = read_plan.tail([a, b], 5)
    assert len(left) == 1 and bytes(left[0]) == bytes(b[1:])


# ---------------------------------------------------------------- the store, counted by the kernel


@needs_io
def test_bundle_is_one_read_syscall(tiny_random_converted):
    m = read_manifest(tiny_random_converted)
    assert m.layout == "bundled" and m.version == 2
    with ExpertStore(m) as s:
        s.residency_method = "mincore"  # classed before reading: no RWF_NOWAIT try
        layer = m.moe_layers[1]
        ref = stacked_reference(tiny_random_converted / m.layers[layer].file)
        for cold in (True, False):
            if cold:
                s.drop_page_cache()
            buf = _buffers(s, layer)
            rows: list[dict] = []
            assert _reads(lambda b=buf, r=rows: r.append(s.read_bundle(layer, 9, b))) == 1, cold
            row = rows[0]
            assert row["bytes"] == m.bundle_bytes
            for n, v in buf.items():
                assert np.array_equal(v, ref[n][9]), n


@needs_io
def test_stacked_layout_still_reads_one_range_per_tensor(tiny_random_stacked):
    m = read_manifest(tiny_random_stacked)
    assert m.layout == "stacked"
    with ExpertStore(m) as s:
        s.residency_method = "mincore"
        layer = m.moe_layers[0]
        ref = stacked_reference(tiny_random_stacked / m.layers[layer].file)
        buf = _buffers(s, layer)
        assert _reads(lambda: s.read_bundle(layer, 3, buf)) == len(m.layers[layer].tensors)
        for n, v in buf.items():
            assert np.array_equal(v, ref[n][3]), n


@needs_io
def test_whole_layer_scatters_within_the_iovec_limit(tiny_random_converted):
    m = read_manifest(tiny_random_converted)
    layer = m.moe_layers[2]
    ref = stacked_reference(tiny_random_converted / m.layers[layer].file)
    slices = len(m.layers[layer].tensors)
    assert m.bundle_bytes % 4096  # tiny-random's bundles carry padding: read through
    experts = m.num_experts
    # By hand: a bundle is 9 iovecs and its padding 1 more. Without a limit, the whole layer
    # is one read; 19 iovecs hold two bundles and the padding between them; 10 hold one
    # bundle (its padding would need an 11th with the next bundle, which starts a new read).
    cases = {read_plan.IOV_MAX: 1, 2 * slices + 1: experts // 2, slices + 1: experts}
    with ExpertStore(m) as s:
        s.residency_method = "mincore"
        for limit, want in cases.items():
            s.iov_max = limit
            stacks = _stacks(s, layer)
            assert _reads(lambda st=stacks: s.read_layer(layer, st)) == want, limit
            for n, v in stacks.items():
                assert np.array_equal(v, ref[n]), (limit, n)


def test_o_direct_bundle_reads_the_same_bytes(tiny_random_converted):
    m = read_manifest(tiny_random_converted)
    with ExpertStore(m, o_direct=True) as s:
        if not s.direct:
            pytest.skip(f"O_DIRECT refused here: {s.direct_fallback}")
        layer = m.moe_layers[0]
        ref = stacked_reference(tiny_random_converted / m.layers[layer].file)
        for e in (0, m.num_experts - 1):
            buf = _buffers(s, layer)
            s.read_bundle(layer, e, buf)
            for n, v in buf.items():
                assert np.array_equal(v, ref[n][e]), (e, n)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("version", [0, 3, "2"])
def test_unknown_layout_version_is_one_line(tiny_random_converted, model_copy, version):
    root = model_copy(tiny_random_converted)
    d = json.loads((root / MANIFEST_FILE).read_text())
    d["version"] = version
    (root / MANIFEST_FILE).write_text(json.dumps(d))
    with pytest.raises(BadInput) as err:
        read_manifest(root)
    msg = str(err.value)
    assert "\n" not in msg and str(root / MANIFEST_FILE) in msg and "re-convert" in msg


def test_unknown_layout_name_is_one_line(tiny_random_converted, model_copy):
    root = model_copy(tiny_random_converted)
    d = json.loads((root / MANIFEST_FILE).read_text())
    d["layout"] = "striped"
    (root / MANIFEST_FILE).write_text(json.dumps(d))
    with pytest.raises(BadInput, match="layout 'striped' unknown"):
        read_manifest(root)


def test_a_bundle_cut_short_names_file_and_expert(tiny_random_converted, model_copy):
    from engine.store import ExpertReadError

    root = model_copy(tiny_random_converted)
    m = read_manifest(root)
    layer = m.moe_layers[-1]
    last = m.num_experts - 1
    off, _ = m.layers[layer].expert_range("up_proj.weight", last)
    with ExpertStore(m) as s:
        os.truncate(root / m.layers[layer].file, off + 100)
        with pytest.raises(ExpertReadError) as err:
            s.read_bundle(layer, last, _buffers(s, layer))
    msg = str(err.value)
    assert "\n" not in msg and m.layers[layer].file in msg and f"expert {last}" in msg


def test_the_budget_charges_the_pages_a_bundle_touches_once():
    from engine.page_cache_budget import page_extents

    # a bundled layout's slices: back to back, sharing pages with each other
    assert page_extents([(4096, 3000), (7096, 2000), (9096, 100)], 4096) == [(4096, 8192)]
    # the stacked layout's: far apart, each rounded out on its own
    assert page_extents([(100, 10), (8192, 5000)], 4096) == [(0, 4096), (8192, 8192)]
