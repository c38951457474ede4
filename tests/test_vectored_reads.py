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
from store_helpers import expert_buffers

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
            buf = expert_buffers(s, layer)
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
        buf = expert_buffers(s, layer)
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
            buf = expert_buffers(s, layer)
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
            s.read_bundle(layer, last, expert_buffers(s, layer))
    msg = str(err.value)
    assert "\n" not in msg and m.layers[layer].file in msg and f"expert {last}" in msg


def test_the_budget_charges_the_pages_a_bundle_touches_once():
    from engine.page_cache_budget import page_extents

    # a bundled layout's slices: back to back, sharing pages with each other
    assert page_extents([(4096, 3000), (7096, 2000), (9096, 100)], 4096) == [(4096, 8192)]
    # the stacked layout's: far apart, each rounded out on its own
    assert page_extents([(100, 10), (8192, 5000)], 4096) == [(0, 4096), (8192, 8192)]


# ---------------------------------------------------------------- what a read costs the reader


def test_a_read_target_is_checked_once_and_reads_the_same_bytes(tiny_random_converted):
    """A ReadTarget (a slot or pool row: the same buffers for many reads) is checked against
    the layer's slices on its first read and kept in file order; later reads into it skip the
    check and read the same bytes as a plain mapping. A bad buffer is still named on the
    first read, and the target is then not taken as checked."""
    m = read_manifest(tiny_random_converted)
    layer = m.moe_layers[0]
    ref = stacked_reference(tiny_random_converted / m.layers[layer].file)
    with ExpertStore(m) as s:
        target = read_plan.ReadTarget(expert_buffers(s, layer))
        assert target.checked is None
        for e in (0, 5, m.num_experts - 1):
            s.read_bundle(layer, e, target)
            assert target.checked is not None
            assert [v is target[n] for n, v in zip(m.layers[layer].tensors,
                                                   target.checked[1], strict=True)] == \
                [True] * len(target)
            for n, v in target.items():
                assert np.array_equal(v, ref[n][e]), (e, n)
        other = m.moe_layers[1]  # the same slices: the same target reads that layer too
        s.read_bundle(other, 2, target)
        ref2 = stacked_reference(tiny_random_converted / m.layers[other].file)
        assert all(np.array_equal(v, ref2[n][2]) for n, v in target.items())
        bad = target  # checked: replacing a buffer makes it checked again
        name = next(iter(bad))
        bad[name] = np.zeros(bad[name].size + 1, bad[name].dtype)
        assert bad.checked is None and bad.iovecs is None
        with pytest.raises(ValueError, match=f"layer {layer} expert 3: buffer of"):
            s.read_bundle(layer, 3, bad)
        assert bad.checked is None


def test_a_warm_small_bundle_is_copied_holding_the_gil(tiny_random_converted, monkeypatch):
    """A bundle the page cache holds, read into a ReadTarget, is one preadv called through
    libc without letting go of the GIL (a copy of a few microseconds; a reader that let go
    would wait for the main thread to hand it back); a cold one, or one into a plain mapping,
    goes through os.preadv, which lets go while the device works. Same bytes either way."""
    import ctypes

    from engine import range_reads

    assert isinstance(range_reads.libc_holding_gil, ctypes.PyDLL)  # PyDLL: the GIL is kept
    calls: list[int] = []
    real = os.preadv

    def counting(fd, buffers, offset, *flags):
        calls.append(offset)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(range_reads.os, "preadv", counting)
    m = read_manifest(tiny_random_converted)
    layer = m.moe_layers[1]
    ref = stacked_reference(tiny_random_converted / m.layers[layer].file)
    with ExpertStore(m) as s:
        s.residency_method = "mincore"  # classed before reading: no RWF_NOWAIT try
        target = read_plan.ReadTarget(expert_buffers(s, layer))
        s.drop_until_cold(layer, settle_s=0.01)
        if s.page_cache_bytes(layer) != 0:
            pytest.skip("the page cache kept the file's pages")
        calls.clear()  # the open-time RWF_NOWAIT probe's
        assert s.read_bundle(layer, 7, target)["cold"] is True
        assert len(calls) == 1  # cold: os.preadv, the GIL let go
        assert s.read_bundle(layer, 7, target)["cold"] is False
        assert len(calls) == 1  # warm: libc's preadv, the GIL kept
        assert all(np.array_equal(v, ref[n][7]) for n, v in target.items())
        plain = expert_buffers(s, layer)
        s.read_bundle(layer, 7, plain)
        assert len(calls) == 2  # no iovec array to hand libc: os.preadv
        assert all(np.array_equal(v, ref[n][7]) for n, v in plain.items())


def test_an_rwf_nowait_copy_of_a_small_bundle_keeps_the_gil(tiny_random_converted,
                                                           monkeypatch):
    """Where RWF_NOWAIT classes loads, its try (which never waits for the device) is libc's
    preadv2 holding the GIL for a small bundle into a ReadTarget: a warm load makes no
    os.preadv call; a cold one is refused there and finished by os.preadv, letting go of the
    GIL while the device works. Same bytes either way."""
    from engine import range_reads

    if range_reads._preadv2_holding_gil is None:
        pytest.skip("libc has no preadv2")
    calls: list[int] = []
    real = os.preadv

    def counting(fd, buffers, offset, *flags):
        calls.append(offset)
        return real(fd, buffers, offset, *flags)

    m = read_manifest(tiny_random_converted)
    layer = m.moe_layers[2]
    ref = stacked_reference(tiny_random_converted / m.layers[layer].file)
    with ExpertStore(m) as s:
        if s._nowait is None:
            pytest.skip("no RWF_NOWAIT on this platform")
        s.residency_method = "rwf_nowait"  # forced: this kernel's probe may refuse it
        target = read_plan.ReadTarget(expert_buffers(s, layer))
        s.drop_until_cold(layer, settle_s=0.01)
        if s.page_cache_bytes(layer) != 0:
            pytest.skip("the page cache kept the file's pages")
        monkeypatch.setattr(range_reads.os, "preadv", counting)
        assert s.read_bundle(layer, 4, target)["cold"] is True
        assert len(calls) == 1  # refused without waiting, then os.preadv: the GIL let go
        assert all(np.array_equal(v, ref[n][4]) for n, v in target.items())
        for v in target.values():
            v[...] = 0
        assert s.read_bundle(layer, 4, target)["cold"] is False
        assert len(calls) == 1  # warm: libc's preadv2, the GIL kept
        assert all(np.array_equal(v, ref[n][4]) for n, v in target.items())


def test_read_warm_finishes_a_short_read_through_the_checked_path(tmp_path):
    """read_warm is one libc preadv into an iovec array; where it comes back short (the file
    is shorter than the range) read_buffered finishes it, and names the short read; a failed
    one raises its error (not retried as if it were short)."""
    from engine import range_reads

    data = np.arange(300, dtype=np.uint8)
    f = tmp_path / "f.bin"
    f.write_bytes(data.tobytes())
    fd = os.open(f, os.O_RDONLY)
    try:
        views = [np.zeros(40, np.uint8), np.zeros(60, np.uint8)]
        range_reads.read_warm(fd, 100, 100, views, range_reads.iovec_array(views), 300)
        assert bytes(views[0]) == bytes(data[100:140]) and bytes(views[1]) == bytes(data[140:200])
        views = [np.zeros(50, np.uint8), np.zeros(50, np.uint8)]
        with pytest.raises(range_reads.RangeReadError, match="short read at byte 300"):
            range_reads.read_warm(fd, 250, 100, views, range_reads.iovec_array(views), 400)
        assert bytes(views[0]) == bytes(data[250:300])  # what there was, in place
        with pytest.raises(range_reads.RangeReadError, match="Bad file descriptor"):
            range_reads.read_warm(-1, 0, 100, views, range_reads.iovec_array(views), 300)
    finally:
        os.close(fd)


def test_residency_of_one_span_counts_each_page_once(tmp_path):
    """A bundle's residency is one mincore over its span (its slices joined): pages that two
    slices share count once. Pages 2 and 5 of an 8-page file read into the cache: the span
    of pages 1-5 holds 2 of its 5 pages; as the old per-slice ranges, page 2 (shared by two
    slices) counted twice."""
    from engine.platform import PAGE, ResidencyProbe, map_for_residency, unmap

    f = tmp_path / "f.bin"
    f.write_bytes(bytes(8 * PAGE))
    fd = os.open(f, os.O_RDONLY)
    addr = map_for_residency(fd, 8 * PAGE)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        probe = ResidencyProbe()
        if probe.resident_pages(addr, [(0, 8 * PAGE)])[0]:
            pytest.skip("the page cache kept the fresh file's pages")
        os.pread(fd, 1, 2 * PAGE)
        os.pread(fd, 1, 5 * PAGE)
        assert probe.resident_pages(addr, [(0, 8 * PAGE)]) == (2, 8)
        assert probe.resident_pages(addr, [(PAGE + 10, 5 * PAGE - 20)]) == (2, 5)
        slices = [(PAGE + 10, PAGE + 100), (2 * PAGE + 110, 4 * PAGE - 130)]  # that span
        assert probe.resident_pages(addr, slices) == (3, 6)  # page 2 in both ranges
    finally:
        unmap(addr, 8 * PAGE)
        os.close(fd)
