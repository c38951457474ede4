"""ExpertStore's cold/warm classification under both residency methods ("rwf_nowait": read with
RWF_NOWAIT first; "mincore": ask before reading): cold after a drop, warm after a read, cold when
only part of a bundle is resident, bytes equal to the file's, read errors still name layer,
expert and file, and a warm RWF_NOWAIT load is one syscall for the whole bundle."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
from store_helpers import expert_buffers

from engine.manifest import TENSOR_NAMES, read_manifest
from engine.store import PAGE, ExpertReadError, ExpertStore

METHODS = ("rwf_nowait", "mincore")


def _open(root, method: str) -> ExpertStore:
    s = ExpertStore(read_manifest(root))
    if method == "rwf_nowait" and s.residency_method != "rwf_nowait":
        s.close()
        pytest.skip(f"RWF_NOWAIT not usable here: {s.residency_fallback}")
    s.residency_method = method
    s.drop_page_cache()
    if s.page_cache_bytes() != 0:
        s.close()
        pytest.skip("this filesystem keeps file pages resident (tmpfs?): fadvise cannot drop")
    return s


def _file_bytes(root, store: ExpertStore, layer: int, expert: int) -> dict[str, bytes]:
    """The bundle's bytes read with plain open/seek/read at offset + expert * stride, with
    readahead off: a plain read's asynchronous readahead can still be in flight when a test
    then drops the pages, and land in the page cache after the drop (seen in fresh-clone
    runs: a just-dropped bundle read warm)."""
    entry = store.manifest.layers[layer]
    out = {}
    with open(root / entry.file, "rb") as fh:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        for n in TENSOR_NAMES:
            t = entry.tensors[n]
            fh.seek(t.offset + expert * t.stride)
            out[n] = fh.read(t.nbytes)
    return out


def _assert_bytes(buf, ref) -> None:
    for n in TENSOR_NAMES:
        assert buf[n].tobytes() == ref[n], n


@pytest.mark.parametrize("method", METHODS)
def test_cold_after_drop_then_warm_same_bytes(method, tiny_random_converted, model_copy):
    root = model_copy(tiny_random_converted)
    with _open(root, method) as s:
        m = s.manifest
        picks = ((m.moe_layers[0], 5), (m.moe_layers[-1], m.num_experts - 1))
        refs = {k: _file_bytes(root, s, *k) for k in [*picks, (m.moe_layers[1], 9)]}
        for layer, e in picks:
            ref = refs[layer, e]
            # A read in flight when pages are dropped survives the drop unseen by mincore and
            # lands after it (a refused RWF_NOWAIT starts one: engine.store). drop_until_cold
            # settles and drops again; 3 tries, each checking its premise: a store that never
            # classes a cold read cold still fails.
            for _ in range(3):
                assert s.drop_until_cold(settle_s=0.02) == 0
                assert s.residency(layer, e) == 0.0
                buf = expert_buffers(s, layer)
                if s.read_bundle(layer, e, buf)["cold"]:
                    break
            else:
                pytest.fail(f"layer {layer} expert {e}: never read cold after a drop")
            _assert_bytes(buf, ref)
            assert s.residency(layer, e) == 1.0  # mincore agrees the read cached it
            buf = expert_buffers(s, layer)
            assert s.read_bundle(layer, e, buf)["cold"] is False
            _assert_bytes(buf, ref)
        s.drop_page_cache()
        assert s.read_bundle(m.moe_layers[0], 5, expert_buffers(s, m.moe_layers[0]))["cold"] is True
        # A whole-layer read goes through the same classification.
        layer = m.moe_layers[1]
        stacks = {n: np.zeros((m.num_experts, *sh), dtype=dt)
                  for n, (sh, dt) in s.expert_shapes(layer).items()}
        assert s.read_layer(layer, stacks)["cold"] is True
        assert s.read_layer(layer, stacks)["cold"] is False
        _assert_bytes({n: stacks[n][9] for n in TENSOR_NAMES}, refs[layer, 9])


@pytest.mark.parametrize("method", METHODS)
def test_partially_resident_bundle_is_cold(method, tiny_random_converted, model_copy):
    root = model_copy(tiny_random_converted)
    with _open(root, method) as s:
        layer, e = s.manifest.moe_layers[2], 6
        ref = _file_bytes(root, s, layer, e)
        s.drop_page_cache()  # plain reads cached pages (with readahead)
        s.read_bundle(layer, e, expert_buffers(s, layer))
        assert s.residency(layer, e) == 1.0
        # Drop the whole pages of one range (gate_proj.weight: page aligned in this layout).
        t = s.manifest.layers[layer].tensors["gate_proj.weight"]
        off, length = t.offset + e * t.stride, t.nbytes
        p0, p1 = -(-off // PAGE), (off + length) // PAGE
        assert p1 > p0
        ranges = s.bundle_ranges(layer, e)  # back to back: the bundle's pages are its span's
        start, end = ranges[0][0], ranges[-1][0] + ranges[-1][1]
        assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
        total = -(-end // PAGE) - start // PAGE
        # Up to 5 tries: on a busy machine the kernel can bring the dropped pages back between
        # the residency check and the read; a store that never sees the bundle cold fails all.
        for _ in range(5):
            os.posix_fadvise(s._files[layer].fd, p0 * PAGE, (p1 - p0) * PAGE,
                             os.POSIX_FADV_DONTNEED)
            time.sleep(0.05)  # let any read the kernel still had in flight settle
            if s.residency(layer, e) == 1.0:
                pytest.skip("the kernel kept the pages (large folios?): no partial bundle")
            # Closed form: each page of the bundle's span counts once (slices share pages).
            assert s.residency(layer, e) == (total - (p1 - p0)) / total
            assert s.is_cold(layer, e)
            buf = expert_buffers(s, layer)
            if s.read_bundle(layer, e, buf)["cold"] is True:
                break
        else:
            pytest.fail("a partially resident bundle was never read as cold")
        _assert_bytes(buf, ref)
        assert s.residency(layer, e) == 1.0
        assert s.read_bundle(layer, e, expert_buffers(s, layer))["cold"] is False


@pytest.mark.parametrize("method", METHODS)
def test_short_read_names_layer_expert_file(method, tiny_random_converted, model_copy):
    root = model_copy(tiny_random_converted)
    with _open(root, method) as s:
        layer, e = s.manifest.moe_layers[3], 20
        t = s.manifest.layers[layer].tensors["up_proj.weight"]
        cut = t.offset + e * t.stride + 1000  # inside the bundle's up_proj.weight range
        # warm: RWF_NOWAIT starts with cached pages
        s.read_bundle(layer, e, expert_buffers(s, layer))
        path = root / s.manifest.layers[layer].file
        os.truncate(path, cut)
        with pytest.raises(ExpertReadError) as err:
            s.read_bundle(layer, e, expert_buffers(s, layer))
        msg = str(err.value)
        assert str(path) in msg and f"layer {layer}" in msg and f"expert {e}" in msg
        assert f"short read at byte {cut}" in msg
        # the file's size now, not the size it had when the store opened it
        assert f"the file has {cut} bytes, {s.manifest.files[s.manifest.layers[layer].file].size}"\
            f" expected" in msg


@pytest.mark.parametrize("method", METHODS)
def test_eio_names_layer_expert_file(method, tiny_random_converted, monkeypatch):
    with _open(tiny_random_converted, method) as s:
        real = os.preadv

        def failing(fd, buffers, offset, *flags):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(ExpertReadError) as err:
            s.read_bundle(1, 3, expert_buffers(s, 1))
        monkeypatch.setattr(os, "preadv", real)
        msg = str(err.value)
        assert "layer 1" in msg and "expert 3" in msg and "Input/output error" in msg
        assert s.manifest.layers[1].file in msg


def test_warm_nowait_load_is_one_syscall(tiny_random_converted, monkeypatch):
    with _open(tiny_random_converted, "rwf_nowait") as s:
        calls: list[tuple[int, int, tuple]] = []
        real = os.preadv

        def counting(fd, buffers, offset, *flags):
            calls.append((offset, sum(memoryview(b).nbytes for b in buffers), flags))
            return real(fd, buffers, offset, *flags)

        monkeypatch.setattr(os, "preadv", counting)
        ranges = s.bundle_ranges(0, 11)
        s.read_bundle(0, 11, expert_buffers(s, 0))  # cold: every range tried without waiting first
        whole = (ranges[0][0], sum(n for _, n in ranges))  # the bundled layout: one range
        assert calls[0] == (*whole, (os.RWF_NOWAIT,))
        assert len(calls) == 2 and calls[1][2] == ()  # the rest from one blocking read
        calls.clear()
        assert s.read_bundle(0, 11, expert_buffers(s, 0))["cold"] is False
        assert calls == [(*whole, (os.RWF_NOWAIT,))]


def test_nowait_probe_falls_back_to_mincore(tiny_random_converted, monkeypatch):
    m = read_manifest(tiny_random_converted)
    real = os.preadv

    def refusing(fd, buffers, offset, *flags):
        if flags:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refusing)
    with ExpertStore(m) as s:
        assert s.residency_method == "mincore"
        assert os.strerror(errno.EOPNOTSUPP) in s.residency_fallback
        s.drop_page_cache()
        if s.page_cache_bytes() == 0:
            assert s.read_bundle(0, 1, expert_buffers(s, 0))["cold"] is True
        assert s.read_bundle(0, 1, expert_buffers(s, 0))["cold"] is False
    monkeypatch.setattr(os, "preadv", real)
    monkeypatch.delattr(os, "RWF_NOWAIT")  # as on macOS (engine.platform reads it)
    with ExpertStore(m) as s:
        assert s.residency_method == "mincore" and "RWF_NOWAIT" in s.residency_fallback
    with ExpertStore(m, o_direct=True) as s:
        assert s.residency_method == "mincore"


@pytest.mark.parametrize("method", METHODS)
def test_read_if_warm_copies_only_a_fully_cached_bundle(method, tiny_random_converted,
                                                        model_copy, monkeypatch):
    root = model_copy(tiny_random_converted)
    with _open(root, method) as s:
        layer, e = s.manifest.moe_layers[1], 7
        ref = _file_bytes(root, s, layer, e)
        s.drop_page_cache()
        blocking = []
        real = os.preadv

        def watching(fd, buffers, offset, *flags):
            if not flags:
                blocking.append(offset)
            return real(fd, buffers, offset, *flags)

        monkeypatch.setattr(os, "preadv", watching)
        assert s.read_bundle_if_warm(layer, e, expert_buffers(s, layer)) is None  # cold: refused
        assert blocking == []  # ... without waiting for the device
        monkeypatch.setattr(os, "preadv", real)
        s.read_bundle(layer, e, expert_buffers(s, layer))  # now cached
        buf = expert_buffers(s, layer)
        row = s.read_bundle_if_warm(layer, e, buf, thread="main")
        assert row is not None and row["cold"] is False and row["thread"] == "main"
        assert row["bytes"] == sum(n for _, n in s.bundle_ranges(layer, e))
        _assert_bytes(buf, ref)
        # A read that a refused warm attempt sent to a reader stays cold in its row, even if
        # the kernel's readahead has cached the pages by the time the reader gets to it.
        buf = expert_buffers(s, layer)
        assert s.read_bundle(layer, e, buf, known_cold=True)["cold"] is True
        _assert_bytes(buf, ref)
    with ExpertStore(read_manifest(root), o_direct=True) as s:  # O_DIRECT: never a copy
        if s.direct:
            assert s.read_bundle_if_warm(layer, e, expert_buffers(s, layer)) is None
